# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""External-load verification (R147) on vLLM 0.33.0: the worker's slots.

The logic is in engine/external_loads.py (`ExternalLoadChecks`), a part of
prefix-hit verification (engine/prefix_hit_checks.py) that the checksum
scheduler's `attach_prefix_cache` sets up with the flag on and that its
`schedule_prefix_hits` and `verify_prefix_hits` run: the calls the in-tree
series' Scheduler makes, which the plugin's scheduler hooks make through
wiring/prefix_cache.py. It wraps no vLLM method of its own.

Hooks (target; why; how; the upstream change that lets it go):

(through the ActiveKVConnector.__init__ hook, wiring/worker.py)
    Why: each worker keeps the entries of computed blocks in slots by block
    hash, for the loads checked against them
    How: `enable_external_entries(limit)` on the checksum worker it created
    Upstream: `create_kv_checksum_worker` doing it with the flag on (series
    commit "[KVConnector] Verify KV loaded back from external caches")
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags


def enable_worker(worker: Any, vllm_config: Any) -> None:
    """R147. Called by the ActiveKVConnector.__init__ hook: the worker keeps
    entries in slots for external loads (the series' `create_kv_checksum_
    worker` does it; again here is harmless). An error is left to that
    hook's guard, which turns this worker's checksums off and tells the
    scheduler (R134): a worker without slots, checking what the scheduler
    asks, would report false mismatches."""
    flags = read_flags(vllm_config.kv_transfer_config)
    if flags.verify_external_loads:
        worker.enable_external_entries(flags.external_entry_limit)
