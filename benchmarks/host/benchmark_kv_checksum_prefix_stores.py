# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One checksum per cached block, on CPU (issue 30, R140): the offload tier's
stores sharing the entries prefix-hit verification already wrote, against the
same engine checksumming each stored block a second time, in one run.

Two `SimpleOffloadSimEngine`s (vLLM's real Scheduler and
SimpleCPUOffloadConnector, the plugin's real checksum workers on CPU KV
caches, vLLM's copies simulated) with `kv_checksum_verify_prefix_hits` on:
"shared" as the package runs, and "separate" with the sharing turned off
(the scheduler side's `entries_written` unset and the worker's prefix
entries saved whole: the package before 9e288ff). Both serve the same
requests over shared 4-block prefixes in interleaved rounds. Timed, per
round: worker 0's entry writes (`BlockChecksumTable.save` and, since the
step's prefix entries ride in its launch, `ChecksumLauncher.launch`) and the
scheduler side's `attach` (where the sharing filters the
store runs); counted: the blocks those writes checksum. The checksum
kernels are stubbed (host time only, as on the engine's step) unless
`--cpu-kernels`.

Run from the repository root:
    python benchmarks/host/benchmark_kv_checksum_prefix_stores.py [--rounds 5]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    cpu_cuda_streams,
    make_request,
    write_model_dir,
)
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (  # noqa: E402
    SimpleOffloadSimEngine,
    shared_prefix_prompts,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_checksum import plugin  # noqa: E402
from vllm.distributed.kv_transfer.kv_checksum.config import (  # noqa: E402
    VERIFY_PREFIX_HITS_KEY,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (  # noqa: E402
    FullBlocks,
)

BS = 16
NUM_PREFIXES = 6


def build(model_dir: str, mode: str, lazy: bool) -> SimpleOffloadSimEngine:
    """An engine with prefix-hit verification over SimpleCPUOffloadConnector;
    "separate" turns the entry sharing off on both sides."""
    extra = {
        "cpu_bytes_to_use": 1 << 22,
        "num_cpu_blocks": 64,
        "lazy_offload": lazy,
        VERIFY_PREFIX_HITS_KEY: True,
    }
    side = SideConfig(
        num_blocks=24, connector="SimpleCPUOffloadConnector", connector_extra=extra
    )
    engine = SimpleOffloadSimEngine(model_dir, side, f"{mode}-{lazy}")
    for worker in engine.workers:
        worker.checksum.enable_prefix_entries()
        table = worker.checksum.block_table
        if mode == "separate":
            table.prefix_blocks_to_write = (  # type: ignore[method-assign]
                lambda runs: (
                    runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
                )
            )
    if mode == "separate":
        engine.offload.__dict__["_kv_checksum_simple_offload"].entries_written = None
    engine.checksummed = 0  # type: ignore[attr-defined]
    engine.timed = {"save": 0.0, "attach": 0.0}  # type: ignore[attr-defined]
    worker = engine.workers[0].checksum
    table = worker.block_table
    entry_rows = table.entry_rows

    def counted(blocks: Any, allowed: Any) -> Any:
        per_group = entry_rows(blocks, allowed)
        rows = sum(part.rows.shape[1] for part in per_group)
        engine.checksummed += rows  # type: ignore[attr-defined]
        return per_group

    table.entry_rows = counted  # type: ignore[method-assign]
    # The entry writes: a store's own save, and the step's launch that
    # carries the prefix entries (with the step's checks, since 2026-12-02g).
    for owner, name in ((table, "save"), (worker.launcher, "launch")):
        setattr(owner, name, _timed(engine, getattr(owner, name)))
    scheduler_side = engine.offload.__dict__["_kv_checksum_simple_offload"]
    attach = scheduler_side.attach

    def timed_attach(metadata: Any) -> None:
        start = time.perf_counter()
        attach(metadata)
        engine.timed["attach"] += time.perf_counter() - start  # type: ignore[attr-defined]

    scheduler_side.attach = timed_attach
    return engine


def _timed(engine: Any, method: Any) -> Any:
    """`method`, adding its wall time to the engine's "save" figure."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            engine.timed["save"] += time.perf_counter() - start

    return timed


def round_of(engine: Any, prompts: list[list[int]], tag: str) -> dict[str, float]:
    """Serve `prompts` one at a time; the round's us in entry writes and in
    the scheduler side's attach."""
    engine.timed.update(save=0.0, attach=0.0)
    for i, tokens in enumerate(prompts):
        req_id = f"{tag}-{i}"
        engine.add(make_request(req_id, tokens, max_tokens=2, block_size=BS))
        engine.run(req_id)
    return {k: 1e6 * v for k, v in engine.timed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24, help="per round")
    parser.add_argument("--lazy", action="store_true", help="lazy offload mode")
    parser.add_argument("--cpu-kernels", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    plugin.register()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()))
    import pytest  # its MonkeyPatch undoes the CPU stand-ins for CUDA streams

    from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (
        KVChecksumLaunch,
    )

    modes = ("shared", "separate")
    rows: dict[str, dict[str, list[float]]] = {
        m: {"save": [], "attach": []} for m in modes
    }
    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        if not args.cpu_kernels:
            patch.setattr(KVChecksumLaunch, "__call__", lambda *a, **k: None)
        engines = {m: build(model_dir, m, args.lazy) for m in modes}
        for r in range(args.rounds):
            prompts = shared_prefix_prompts(args.requests, NUM_PREFIXES, seed=r)
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                for kind, us in round_of(engines[mode], prompts, f"r{r}").items():
                    rows[mode][kind].append(us)
    result = {
        mode: {
            "entry_writes_us_per_round": round(statistics.median(rows[mode]["save"])),
            "attach_us_per_round": round(statistics.median(rows[mode]["attach"])),
            "blocks_checksummed": engines[mode].checksummed,
            "blocks_stored": engines[mode].num_stored_blocks,
            "load_verdicts": verdicts(engines[mode]),
        }
        for mode in modes
    }
    print(
        f"SimpleCPUOffloadConnector ({'lazy' if args.lazy else 'eager'}) with "
        f"prefix-hit verification, CPU, kernels "
        f"{'run' if args.cpu_kernels else 'stubbed'}, {args.rounds} interleaved "
        f"rounds of {args.requests} requests; us: median over rounds"
    )
    print(
        "| entries | entry writes and step launches, us a round | attach, us a round "
        "| blocks checksummed | blocks stored | host loads |"
    )
    print("|---|---|---|---|---|---|")
    for mode in modes:
        row = result[mode]
        print(
            f"| {mode} | {row['entry_writes_us_per_round']} | "
            f"{row['attach_us_per_round']} | {row['blocks_checksummed']} | "
            f"{row['blocks_stored']} | {row['load_verdicts']} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
