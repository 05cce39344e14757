# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine tiers of `benchmark_kv_checksum_prefix_hits.py` (issue 26 item 3):
each tier's `--kv-transfer-config` off and on, the GPU KV cache that makes the
offload tiers load from host memory, and the host-load counters of /metrics.

- ``simple-hits``: SimpleCPUOffloadConnector; on adds
  `kv_checksum_verify_prefix_hits` (local prefix-cache hits checked).
- ``offloading``: OffloadingConnector alone (CPU backend); the package's keys
  next to `cpu_bytes_to_use`, as the guide's "Connectors" section says.
- ``multi``: MultiConnector(NixlConnector, OffloadingConnector), built as the
  chaos runs build it; the package's keys in the MultiConnector's extra config.
- ``simple-stores``: ``simple-hits`` without the prefix-hit flag (checksums of
  the blocks SimpleCPUOffloadConnector stores only): beside ``simple-hits`` it
  tells the cost of hit checks from that of the connector's store checksums.
- ``simple-offload``: SimpleCPUOffloadConnector with the offload tiers' small
  GPU cache, so reuses load from host memory (issue 30 item 3); on adds the
  load checksums only, as for ``offloading``.
- ``lmcache``: LMCacheConnectorV1 (lmcache 0.5.6) with its local CPU backend
  (configured by LMCache's environment variables, `lmcache_env`) and the
  offload tiers' small GPU cache, so reuses load back from LMCache (issue 78
  item 3); on adds `kv_checksum_verify_external_loads`. Its loads are counted
  by vLLM's `vllm:external_prefix_cache_hits` and the package's
  `vllm:kv_checksum_external_loads` verdicts.

`off` is the same connector config without any of the package's keys; `on`
adds `enable_kv_checksum` and `kv_checksum_fail_closed` (plus the prefix-hit
flag for ``simple-hits`` only). `kv_load_failure_policy` "recompute" is vLLM's
own key and set on both.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples/disaggregated"))
from kv_checksum_chaos_plan import ServerSpec, kv_transfer_config  # noqa: E402

TIERS = (
    "simple-hits",
    "offloading",
    "multi",
    "simple-stores",
    "simple-offload",
    "lmcache",
)
# The tiers whose reuses load from host memory (a small GPU cache).
OFFLOAD_TIERS = ("offloading", "multi", "simple-offload", "lmcache")
# Per tier: rounds and workloads by default, the CPU tier's GiB. Measured at 8B
# on an H200 (2026-12-01): 116 s to start both engines, 31-38 s a round of one
# workload (the bench CLI's start included); 6 rounds of two workloads did not
# fit a 480 s call. Prefix hits: 8 rounds of one workload, ~400 s; an offload
# tier: 4 rounds, ~270 s (estimated).
TIER_DEFAULTS: dict[str, tuple[int, str, int]] = {
    "simple-hits": (8, "shared_c1,shared_c32", 8),
    "offloading": (4, "host16_c8", 16),
    "multi": (4, "host16_c8", 16),
    "simple-stores": (8, "shared_c1,shared_c32", 8),
    "simple-offload": (4, "host16_c8", 16),
    "lmcache": (4, "host16_c8", 16),
}
# vLLM's host-load counters (prometheus_client names): OffloadingConnector's
# bytes loaded from host memory and one histogram sample per load transfer;
# SimpleCPUOffloadConnector's blocks loaded; tokens an external cache (LMCache)
# hit.
HOST_LOADS = re.compile(
    r"^vllm:(?:(?:simple_)?kv_offload_load_|external_prefix_cache_)"
    r"(bytes_total|size_count|blocks_total|hits_total)\{[^}]*\} (\S+)"
)
# The counters of HOST_LOADS that say a load happened, one per connector.
LOADED_KEYS = ("size_count", "blocks_total", "hits_total")
# The package's verdict counter of each tier's loads.
LOAD_VERDICTS = re.compile(
    r'^vllm:kv_checksum_loads_total\{[^}]*verdict="(\w+)"[^}]*\} (\S+)'
)
EXTERNAL_VERDICTS = re.compile(
    r'^vllm:kv_checksum_external_loads_total\{[^}]*verdict="(\w+)"[^}]*\} (\S+)'
)
# LMCache's chunk: 256 tokens, its default and a multiple of the block size.
LMCACHE_CHUNK_TOKENS = 256
# GPU blocks per request beyond its tokens (a partial last block, rounding).
SPARE_BLOCKS = 2
BLOCK_TOKENS = 16
KV_ELEMENT_BYTES = 2  # bf16


def transfer_config(mode: str, cpu_gib: int, tier: str = "simple-hits") -> dict:
    """The `--kv-transfer-config` of an engine of `tier`; `on` adds the
    package's keys (and nothing else)."""
    on = mode == "on"
    host = {"cpu_bytes_to_use": cpu_gib << 30}
    if tier == "multi":
        spec = ServerSpec(
            "bench", 0, 0, "consumer", checksums=on, fail_closed=on, policy="recompute"
        )
        config = kv_transfer_config(spec, "nixl-offload")
        children = config["kv_connector_extra_config"]["connectors"]
        children[1]["kv_connector_extra_config"] = host
        return config
    # LMCache reads its settings from the environment (`tier_env`).
    extra: dict[str, Any] = {} if tier == "lmcache" else dict(host)
    if on:
        extra["enable_kv_checksum"] = True
        if tier == "simple-hits":
            extra["kv_checksum_verify_prefix_hits"] = True
        if tier == "lmcache":
            extra["kv_checksum_verify_external_loads"] = True
        extra["kv_checksum_fail_closed"] = True
    connector = {
        "offloading": "OffloadingConnector",
        "lmcache": "LMCacheConnectorV1",
    }.get(tier, "SimpleCPUOffloadConnector")
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def tier_env(tier: str, cpu_gib: int) -> dict[str, str]:
    """The environment `tier`'s engines need beside vLLM's: LMCache's local CPU
    backend of `cpu_gib` GiB (the same for both engines), its chunk hashes
    stable across processes, no usage reporting (the GPU host is offline)."""
    if tier != "lmcache":
        return {}
    return {
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gib),
        "LMCACHE_CHUNK_SIZE": str(LMCACHE_CHUNK_TOKENS),
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "0",
    }


def load_verdict_pattern(tier: str) -> re.Pattern[str]:
    """The package's verdict counter of `tier`'s loads: external-cache loads
    for LMCache, connector loads otherwise."""
    return EXTERNAL_VERDICTS if tier == "lmcache" else LOAD_VERDICTS


def kv_bytes_per_token(dims: dict[str, int]) -> int:
    """KV bytes of one token: layers x KV heads x head dim x (K, V) x bf16
    (8B shape: 36 x 8 x 128 x 2 x 2 = 147,456)."""
    heads = dims["num_key_value_heads"] * dims["head_dim"]
    return dims["num_hidden_layers"] * heads * 2 * KV_ELEMENT_BYTES


def offload_kv_cache_bytes(
    dims: dict[str, int],
    concurrency: int,
    request_tokens: int,
    prefix_len: int,
    max_model_len: int,
) -> int:
    """A GPU KV cache for the running requests plus two idle prefixes: the
    workload's other prefixes are evicted from the GPU and hit the CPU tier."""
    blocks = math.ceil(request_tokens / BLOCK_TOKENS) + SPARE_BLOCKS
    tokens = concurrency * blocks * BLOCK_TOKENS + 2 * prefix_len
    return max(tokens, max_model_len) * kv_bytes_per_token(dims)


def kv_cache_bytes(
    tier: str,
    gib: float | None,
    dims: dict[str, int],
    workloads: list[Any],
    max_model_len: int,
) -> int:
    """`gib` when given, else 20 GiB (simple-hits) or the offload tiers' small
    cache, sized for the largest of `workloads` (Workload records)."""
    if gib is not None:
        return int(gib * (1 << 30))
    if tier not in OFFLOAD_TIERS:
        return 20 << 30
    return max(
        offload_kv_cache_bytes(
            dims,
            w.concurrency,
            w.prefix_len + w.suffix_len + w.output_len,
            w.prefix_len,
            max_model_len,
        )
        for w in workloads
    )


def host_load_totals(
    rounds: list[dict[str, Any]], name: str
) -> dict[str, dict[str, float]]:
    """Per mode: the host loads (vLLM's transfer counters) and the package's
    load verdicts summed over the rounds of workload `name`."""
    totals: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    for r in rounds:
        counts = {
            **r.get("host_loads", {}).get(name, {}),
            **r.get("load_verdicts", {}).get(name, {}),
        }
        mode = totals[r["mode"]]
        for key, value in counts.items():
            mode[key] = mode.get(key, 0.0) + value
    return totals


def host_loads_ok(totals: dict[str, dict[str, float]]) -> bool:
    """Host loads happened on both engines and the on engine's were verified
    (at least one) with no mismatch."""
    off, on = totals["off"], totals["on"]
    loaded = all(any(mode.get(key, 0) > 0 for key in LOADED_KEYS) for mode in (off, on))
    return loaded and on.get("verified", 0) > 0 and on.get("mismatch", 0) == 0
