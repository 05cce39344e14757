# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The two user flags and the single decision whether checksums are on (R8-R16).

vLLM 0.33.0's KVTransferConfig forbids unknown fields, so the flags live at the
top level of `kv_transfer_config.kv_connector_extra_config`. Every process
(scheduler and workers) calls `kv_checksum_enabled` on the same config and
gets the same answer.
"""

import math
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

ENABLE_KEY = "enable_kv_checksum"
FAIL_CLOSED_KEY = "kv_checksum_fail_closed"
MAX_PAYLOAD_BYTES_KEY = "kv_checksum_max_payload_bytes"
FAULT_INJECTION_KEY = "kv_checksum_fault_injection"
# R140: verify local prefix-cache hits against entries recorded at caching.
VERIFY_PREFIX_HITS_KEY = "kv_checksum_verify_prefix_hits"
# R147: verify KV a connector loads back from an external cache against the
# entries this engine recorded when it computed those blocks.
VERIFY_EXTERNAL_LOADS_KEY = "kv_checksum_verify_external_loads"
# R147: at most this many such entries are kept (FIFO).
EXTERNAL_ENTRY_LIMIT_KEY = "kv_checksum_external_entry_limit"
# 2**18 entries: 4M tokens at block size 16, several GPU prefix caches' worth,
# for 2 MiB on each worker's device and about 50 MiB in the scheduler.
DEFAULT_EXTERNAL_ENTRY_LIMIT = 1 << 18

# None: the cap is derived from the consumer's own sizes (payload.py's
# `max_valid_payload_bytes`); an explicit setting overrides it.
DEFAULT_MAX_PAYLOAD_BYTES: int | None = None

# The kinds of `kv_checksum_fault_injection` (R131; fault_injection.py applies
# them). Defined here, with the other settings, so config imports no module of
# the package and everything else may import config.
FAULT_KINDS = ("bit_flip", "zero_block", "swap_blocks", "stale_block")
# Opt-in only (not a default kind): one bit of a checked local prefix-cache hit
# block, flipped before its check (R140).
PREFIX_HIT_FAULT = "prefix_hit"
VALID_FAULT_KINDS = (*FAULT_KINDS, PREFIX_HIT_FAULT)
# Host-copy faults of the offload tiers (offload_faults.py applies them).
HOST_FAULT_KEY = "kv_checksum_host_fault_injection"
HOST_FAULT_KINDS = ("host_bit_flip", "host_other_block")

_FLAG_KEYS = (ENABLE_KEY, FAIL_CLOSED_KEY, MAX_PAYLOAD_BYTES_KEY, FAULT_INJECTION_KEY)


@dataclass(frozen=True)
class FaultInjectionConfig:
    """Operator fault injection into loaded KV (R131), off unless configured."""

    rate: float
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0


@dataclass(frozen=True)
class KVChecksumFlags:
    """The user's settings, read from kv_connector_extra_config."""

    enabled: bool = False
    fail_closed: bool = False
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES
    fault_injection: FaultInjectionConfig | None = None
    host_fault_injection: FaultInjectionConfig | None = None
    verify_prefix_hits: bool = False
    verify_external_loads: bool = False
    external_entry_limit: int = DEFAULT_EXTERNAL_ENTRY_LIMIT


def _bool_flag(extra: dict[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}"
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if not _is_int(value) or value <= 0:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a positive integer, "
            f"got {value!r}"
        )
    return int(value)


def read_fault_setting(
    kv_transfer_config: Any,
    key: str,
    valid_kinds: tuple[str, ...],
    default_kinds: tuple[str, ...] | None = None,
) -> FaultInjectionConfig | None:
    """A fault-injection setting (R131) under `key`; None when absent.

    The value is a dict {"rate": number in [0, 1], "kinds": list of
    `valid_kinds` (default `default_kinds`, else all), "seed": int (default
    0)}; anything else,
    unknown keys included, is a start-up error. Shared by the loaded-KV
    injector and the host-copy injector of the offload tiers.
    """
    if kv_transfer_config is None:
        return None
    extra = kv_transfer_config.kv_connector_extra_config or {}
    value = extra.get(key)
    if value is None:
        return None
    where = f"kv_connector_extra_config[{key!r}]"
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict, got {value!r}")
    unknown = sorted(set(value) - {"rate", "kinds", "seed"}, key=str)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}")
    rate = value.get("rate")
    if (
        not isinstance(rate, (int, float))
        or isinstance(rate, bool)
        or not (math.isfinite(rate) and 0 <= rate <= 1)
    ):
        raise ValueError(f"{where}['rate'] must be a number in [0, 1], got {rate!r}")
    kinds = value.get("kinds", list(default_kinds or valid_kinds))
    if (
        not isinstance(kinds, (list, tuple))
        or not kinds
        or any(k not in valid_kinds for k in kinds)
    ):
        raise ValueError(
            f"{where}['kinds'] must be a non-empty list of {list(valid_kinds)}, "
            f"got {kinds!r}"
        )
    seed = value.get("seed", 0)
    if not _is_int(seed):
        raise ValueError(f"{where}['seed'] must be an integer, got {seed!r}")
    return FaultInjectionConfig(float(rate), tuple(dict.fromkeys(kinds)), seed)


def has_native_fields(kv_transfer_config: Any) -> bool:
    """Whether the settings are `KVTransferConfig` fields (a vLLM with the
    in-tree series, patch 0001: validated there, the extra-config spelling
    already mapped onto them)."""
    return hasattr(kv_transfer_config, ENABLE_KEY)


def read_fault_injection(kv_transfer_config: Any) -> FaultInjectionConfig | None:
    """The `kv_checksum_fault_injection` setting (R131); None when absent."""
    if has_native_fields(kv_transfer_config):
        value = kv_transfer_config.kv_checksum_fault_injection
        if value is None:
            return None
        return FaultInjectionConfig(float(value.rate), tuple(value.kinds), value.seed)
    return read_fault_setting(
        kv_transfer_config, FAULT_INJECTION_KEY, VALID_FAULT_KINDS, FAULT_KINDS
    )


def read_flags(kv_transfer_config: Any) -> KVChecksumFlags:
    """The flags of a KVTransferConfig; non-boolean values are an error (R8)."""
    if kv_transfer_config is None:
        return KVChecksumFlags()
    extra = kv_transfer_config.kv_connector_extra_config or {}
    if has_native_fields(kv_transfer_config):
        # Fields since the external-loads commit of the series; before it,
        # only the extra config spells them.
        if hasattr(kv_transfer_config, VERIFY_EXTERNAL_LOADS_KEY):
            verify_external = getattr(kv_transfer_config, VERIFY_EXTERNAL_LOADS_KEY)
            entry_limit = getattr(kv_transfer_config, EXTERNAL_ENTRY_LIMIT_KEY)
        else:
            verify_external = _bool_flag(extra, VERIFY_EXTERNAL_LOADS_KEY)
            entry_limit = _positive_int(
                extra, EXTERNAL_ENTRY_LIMIT_KEY, DEFAULT_EXTERNAL_ENTRY_LIMIT
            )
        return KVChecksumFlags(
            enabled=kv_transfer_config.enable_kv_checksum,
            fail_closed=kv_transfer_config.kv_checksum_fail_closed,
            max_payload_bytes=kv_transfer_config.kv_checksum_max_payload_bytes,
            fault_injection=read_fault_injection(kv_transfer_config),
            host_fault_injection=read_fault_setting(
                kv_transfer_config, HOST_FAULT_KEY, HOST_FAULT_KINDS
            ),
            verify_prefix_hits=kv_transfer_config.kv_checksum_verify_prefix_hits,
            verify_external_loads=verify_external,
            external_entry_limit=entry_limit,
        )
    max_bytes = extra.get(MAX_PAYLOAD_BYTES_KEY, DEFAULT_MAX_PAYLOAD_BYTES)
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(
            f"kv_connector_extra_config[{MAX_PAYLOAD_BYTES_KEY!r}] must be a "
            f"positive integer, got {max_bytes!r}"
        )
    return KVChecksumFlags(
        enabled=_bool_flag(extra, ENABLE_KEY),
        fail_closed=_bool_flag(extra, FAIL_CLOSED_KEY),
        max_payload_bytes=max_bytes,
        fault_injection=read_fault_injection(kv_transfer_config),
        host_fault_injection=read_fault_setting(
            kv_transfer_config, HOST_FAULT_KEY, HOST_FAULT_KINDS
        ),
        verify_prefix_hits=_bool_flag(extra, VERIFY_PREFIX_HITS_KEY),
        verify_external_loads=_bool_flag(extra, VERIFY_EXTERNAL_LOADS_KEY),
        external_entry_limit=_positive_int(
            extra, EXTERNAL_ENTRY_LIMIT_KEY, DEFAULT_EXTERNAL_ENTRY_LIMIT
        ),
    )


_warned: set[str] = set()


def _disable(message: str) -> bool:
    """Log a disabling warning once per process (R16); returns False."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("KV checksums disabled: %s.", message)
    return False


def connector_declares_carrier(kv_transfer_config: Any) -> bool:
    """Whether the configured connector class can verify loads (R15, R100).

    It can if it declares a carrier (overrides `kv_checksum_carrier`) or
    stored-checksum sources for its offload loads (overrides
    `get_kv_checksum_sources`, R119). Not asked with
    `kv_checksum_verify_external_loads`: every connector's loads are then
    checked against this engine's own entries (R147).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )

    connector_cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    if issubclass(connector_cls, MultiConnector):
        from vllm.config import KVTransferConfig

        extra = kv_transfer_config.kv_connector_extra_config or {}
        return any(
            connector_declares_carrier(KVTransferConfig(**child))
            for child in extra.get("connectors", [])
        )
    return any(
        getattr(connector_cls, method, None)
        is not KVConnectorBase_V1.__dict__.get(method)
        for method in ("kv_checksum_carrier", "get_kv_checksum_sources")
    )


def _ray_pp_without_aggregation(parallel: Any) -> bool:
    """A Ray executor whose non-last PP stages' outputs never reach the scheduler."""
    if getattr(parallel, "pipeline_parallel_size", 1) <= 1:
        return False
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend in ("ray", "mp", "uni", "external_launcher", None):
        return False  # 0.33.0's "ray" is the multiprocessing-based Ray V2
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if isinstance(backend, str):
        from vllm.utils.import_utils import resolve_obj_by_qualname

        backend = resolve_obj_by_qualname(backend)
    uses_ray = getattr(backend, "uses_ray", False)
    return bool(uses_ray) and not issubclass(backend, MultiprocExecutor)


def _mentions_checksums(vllm_config: Any) -> bool:
    """Whether a configured connector's settings hold any checksum flag (the
    `KVTransferConfig` fields where vLLM has them, else the extra config).

    Reads nothing but the KV transfer config, tolerating partial or mock
    configs (no KV transfer config, a non-dict extra config: no flags), and
    never raises.
    """
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is None or not getattr(
        kv_transfer_config, "kv_connector", None
    ):
        return False
    if has_native_fields(kv_transfer_config):
        return True  # validated fields: read_flags decides
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    return isinstance(extra, dict) and any(key in extra for key in _FLAG_KEYS)


def kv_checksum_enabled(vllm_config: Any) -> bool:
    """Whether this engine computes and verifies KV checksums (R11-R16).

    Only the KV transfer config is needed: a config without a parallel config
    (e.g. a partial one in a test) counts as having no parallelism. Raises
    ValueError for invalid flags (a start-up error, R8).
    """
    if not _mentions_checksums(vllm_config):
        return False
    kv_transfer_config = vllm_config.kv_transfer_config
    flags = read_flags(kv_transfer_config)
    if not flags.enabled:
        return False
    parallel = getattr(vllm_config, "parallel_config", None)
    if (
        getattr(parallel, "decode_context_parallel_size", 1) > 1
        or getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        return _disable("context parallelism is not supported")
    if _ray_pp_without_aggregation(parallel):
        return _disable(
            "a Ray executor with pipeline parallelism does not return every "
            "stage's connector output"
        )
    if not flags.verify_external_loads and not connector_declares_carrier(
        kv_transfer_config
    ):
        name = kv_transfer_config.kv_connector
        if flags.fail_closed:
            raise ValueError(
                f"KV checksums are fail-closed but connector {name} declares no "
                "carrier for them, so no load could be verified"
            )
        return _disable(f"connector {name} declares no carrier for them")
    return True
