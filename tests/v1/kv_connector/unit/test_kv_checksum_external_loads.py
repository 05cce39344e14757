# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifying KV a connector loads back from an external cache (R147) on vLLM
0.33.0's real Scheduler, KV cache manager and block pool and its real
`ExampleConnector`, both sides: the scheduler side finds the stored prefix on
disk, the worker side stores and loads safetensors files into CPU KV caches
(the standardized [blocks, heads, tokens, bytes] views it indexes), with real
checksum workers (`kv_checksum_pd.SimEngine`: each step's forward writes a
deterministic KV per token and position).

The independent reference is the KV itself: a file changed on disk must be
caught at exactly the blocks whose tokens changed, and a clean file never.
"""

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    make_request,
    native_capability,
    prefix_hit_verifier,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig, SimEngine, SimWorker
from vllm.distributed.kv_transfer.kv_checksum.config import (
    DEFAULT_EXTERNAL_ENTRY_LIMIT,
    EXTERNAL_ENTRY_LIMIT_KEY,
    VERIFY_EXTERNAL_LOADS_KEY,
    VERIFY_PREFIX_HITS_KEY,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.external_loads import (
    ExternalEntryTable,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    KVChecksumWorker,
    create_kv_checksum_worker,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    UnverifiedReason,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
PREFIX = 4 * BS  # ExampleConnector stores and loads 4 full blocks of a prompt
LENGTH = PREFIX + 5


class ExampleEngine(SimEngine):
    """A SimEngine whose connector is vLLM's ExampleConnector on both sides:
    each worker loads the step's files before the forward's KV writes (its
    `start_load_kv`) and stores the step's new prompts after them (its
    `save_kv_layer`, per layer), as vLLM's runner calls them."""

    def __init__(self, model_dir: str, side: SideConfig, name: str) -> None:
        super().__init__(model_dir, side, name)
        self.connectors = [
            ExampleConnector(
                self.vllm_config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
            )
            for _ in self.workers
        ]
        self.before_writes = self._load
        self.after_writes = self._save
        self.verdicts: list[Any] = []
        kcs = self.checksums
        if kcs is not None:
            record = kcs.stats.record_external_load

            def keep(verdict: Any) -> None:
                self.verdicts.append(verdict)
                record(verdict)

            kcs.stats.record_external_load = keep

    def _context(self, worker: Any) -> Any:
        names = list(worker.caches)
        return SimpleNamespace(
            no_compile_layers={
                name: SimpleNamespace(kv_cache=worker.caches[name]) for name in names
            },
            attn_metadata={name: object() for name in names},
        )

    def _load(self, output: Any) -> None:
        for worker, connector in zip(self.workers, self.connectors):
            connector.bind_connector_metadata(output.kv_connector_metadata)
            connector.start_load_kv(self._context(worker))

    def _save(self, output: Any) -> None:
        for worker, connector in zip(self.workers, self.connectors):
            for name, cache in worker.caches.items():
                connector.save_kv_layer(name, cache, object())
            connector.clear_connector_metadata()


def engine_for(
    model_dir: str,
    storage: Path,
    name: str,
    *,
    flag: bool = True,
    limit: int | None = None,
    fail_closed: bool = False,
    policy: str = "recompute",
) -> ExampleEngine:
    extra: dict[str, Any] = {"shared_storage_path": str(storage)}
    if flag:
        extra[VERIFY_EXTERNAL_LOADS_KEY] = True
    if limit is not None:
        extra[EXTERNAL_ENTRY_LIMIT_KEY] = limit
    side = SideConfig(
        num_blocks=48,
        policy=policy,
        fail_closed=fail_closed,
        connector="ExampleConnector",
        connector_extra=extra,
    )
    engine = ExampleEngine(model_dir, side, name)
    if flag:
        for worker in engine.workers:  # as the ActiveKVConnector hook does
            worker.checksum.enable_external_entries(
                limit or DEFAULT_EXTERNAL_ENTRY_LIMIT
            )
    return engine


def prompt(seed: int, length: int = LENGTH) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def run(engine: SimEngine, req_id: str, tokens: list[int]) -> Any:
    engine.add(make_request(req_id, tokens, max_tokens=1, block_size=BS))
    return engine.run(req_id)


def computed_then_loaded(
    engine: ExampleEngine, tokens: list[int], req_id: str = "b"
) -> Any:
    """`tokens` computed once (stored to disk, entries recorded), the prefix
    cache emptied, then requested again: its prefix is loaded from disk."""
    run(engine, f"{req_id}-first", tokens)
    assert engine.scheduler.reset_prefix_cache()
    return run(engine, req_id, tokens)


def layer_files(storage: Path, layer: str | None = None) -> list[Path]:
    files = sorted(storage.glob("*/*.safetensors"))
    return [f for f in files if layer is None or f.name.startswith(layer)]


def rewrite(path: Path, change: Any) -> None:
    """Apply `change` to the stored [tokens, heads, bytes] KV of one file."""
    kv = safetensors.torch.load_file(str(path))["kv_cache"]
    safetensors.torch.save_file({"kv_cache": change(kv.clone())}, str(path))


def corrupt_file_when_stored(engine: ExampleEngine, change: Any) -> None:
    """Change the first layer's file right after the first request stored it."""
    save = engine._save
    done: list[bool] = []

    def save_then_change(output: Any) -> None:
        save(output)
        files = layer_files(Path(engine.side.connector_extra["shared_storage_path"]))
        if files and not done:
            rewrite(files[0], change)
            done.append(True)

    engine.after_writes = save_then_change


def statuses(engine: ExampleEngine) -> list[str]:
    return [v.status.value for v in engine.verdicts]


def test_flags_are_validated() -> None:
    """R147, R8: the flag is a boolean and the limit a positive integer, else
    a start-up error (bug: any truthy value or a zero/boolean limit silently
    accepted, e.g. a table of 0 slots)."""

    class Config:
        kv_connector_extra_config: dict[str, Any] = {}

    assert not read_flags(Config()).verify_external_loads
    assert read_flags(Config()).external_entry_limit == DEFAULT_EXTERNAL_ENTRY_LIMIT
    for bad in ({VERIFY_EXTERNAL_LOADS_KEY: "yes"}, {VERIFY_EXTERNAL_LOADS_KEY: 1}):
        Config.kv_connector_extra_config = bad
        with pytest.raises(ValueError, match=VERIFY_EXTERNAL_LOADS_KEY):
            read_flags(Config())
    for limit in (0, -1, True, "5", 2.0):
        Config.kv_connector_extra_config = {EXTERNAL_ENTRY_LIMIT_KEY: limit}
        with pytest.raises(ValueError, match=EXTERNAL_ENTRY_LIMIT_KEY):
            read_flags(Config())
    Config.kv_connector_extra_config = {
        VERIFY_EXTERNAL_LOADS_KEY: True,
        EXTERNAL_ENTRY_LIMIT_KEY: 7,
    }
    flags = read_flags(Config())
    assert flags.verify_external_loads and flags.external_entry_limit == 7


def test_clean_load_verified(model_dir: str, tmp_path: Path) -> None:
    """R147: a prefix stored by ExampleConnector and loaded back unchanged is
    verified, and the request runs on it (bugs: the step's entries never
    copied into their slots, so every load is unverified; the loaded
    positions counted from 0 instead of after the local hit, a mismatch)."""
    engine = engine_for(model_dir, tmp_path, "clean")
    base = prompt(1)
    computed_then_loaded(engine, base)
    assert statuses(engine) == ["verified"]
    # The prefix was loaded, not computed: b computed only its 5 new tokens.
    assert engine.scheduled_tokens("b") == LENGTH - PREFIX
    assert engine.final["b"].finish_reason is not None
    # After a local hit on 2 blocks, the 2 loaded ones are checked at
    # positions 2 and 3 (their hashes, not those of positions 0 and 1).
    assert engine.scheduler.reset_prefix_cache()
    run(engine, "half", base[: 2 * BS + 3])
    run(engine, "c", base)
    assert statuses(engine) == ["verified", "verified"]
    assert engine.scheduled_tokens("c") == LENGTH - PREFIX


@pytest.mark.parametrize(
    ("fault", "change", "bad_positions"),
    [
        # One byte of token 37 (block 2).
        ("corrupted", lambda kv: _flip(kv, 37), [2]),
        # The file's last 24 tokens lost (zeros, as a writer cut short
        # leaves a preallocated file): blocks 2 and 3.
        ("truncated", lambda kv: _zero_from(kv, PREFIX - 24), [2, 3]),
        # Head-major bytes read as token-major: every block.
        ("other layout", lambda kv: kv.transpose(0, 1).reshape(kv.shape), [0, 1, 2, 3]),
    ],
)
def test_changed_file_caught_at_its_blocks(
    model_dir: str, tmp_path: Path, fault: str, change: Any, bad_positions: list[int]
) -> None:
    """R147, R138, R95: a stored file changed on disk is a mismatch at exactly
    the blocks whose tokens changed; the request is restarted ("recompute"):
    loaded again and caught again, then computed without reading any cache
    (bugs: the checked blocks' entries written again from the loaded KV in
    the same step, so every load verifies; the entries not brought back from
    their slots before the check, so every block mismatches)."""
    engine = engine_for(model_dir, tmp_path, fault.replace(" ", "-"))
    corrupt_file_when_stored(engine, change)
    final = computed_then_loaded(engine, prompt(2))
    assert statuses(engine) == ["mismatch", "mismatch"], fault
    for verdict in engine.verdicts:
        assert verdict.mismatches == {0: bad_positions}
    # Restarted twice, the second time computing the whole prompt.
    assert engine.scheduled_tokens("b") >= LENGTH
    assert final.finish_reason is not None
    if native_capability("containment"):  # R138: its series commit comes later
        assert engine.checksums.stats.quarantined_blocks > 0


def test_swapped_file_caught(model_dir: str, tmp_path: Path) -> None:
    """R147: another prefix's file (same length, same layout, KV this engine
    computed too) in place of the stored one mismatches at every block: the
    entries are bound to the blocks' hashes (bug: the checked blocks' entries
    written again from the loaded KV, so the other prefix's KV is compared
    with its own checksums)."""
    engine = engine_for(model_dir, tmp_path, "swapped")
    base, other = prompt(3), prompt(4)
    run(engine, "other", other)
    other_files = {f.name: f.read_bytes() for f in layer_files(tmp_path)}
    run(engine, "b-first", base)
    for path in layer_files(tmp_path):
        if path.read_bytes() != other_files.get(path.name):
            path.write_bytes(other_files[path.name])
    assert engine.scheduler.reset_prefix_cache()
    run(engine, "b", base)
    assert statuses(engine) == ["mismatch", "mismatch"]
    assert engine.verdicts[0].mismatches == {0: [0, 1, 2, 3]}


def test_load_without_entry_unverified(model_dir: str, tmp_path: Path) -> None:
    """R147, R94: a prefix another instance computed and stored (this engine
    recorded no entry of it) is unverified with the no-entry reason and, fail-
    open, the request runs on it; fail-closed, it is recomputed (bugs: a load
    with no entry judged from its empty comparison, unverified for another
    reason than no_entry; an unverified load failed under fail-open; the entries of
    loaded blocks kept in the table, so the fail-closed retry "verifies" the
    unchecked KV against itself)."""
    base = prompt(5)
    writer = engine_for(model_dir, tmp_path, "writer")
    run(writer, "w", base)
    reader = engine_for(model_dir, tmp_path, "reader")
    run(reader, "b", base)
    assert statuses(reader) == ["unverified"]
    reasons = [r for r, _ in reader.verdicts[0].reasons]
    assert reasons == [UnverifiedReason.NO_ENTRY]
    assert reader.scheduled_tokens("b") == LENGTH - PREFIX  # ran on the load
    assert reader.checksums.stats.unverified_reasons == {
        UnverifiedReason.NO_ENTRY.value: 1
    }
    closed = engine_for(model_dir, tmp_path, "closed", fail_closed=True)
    run(closed, "b", base)
    assert statuses(closed) == ["unverified", "unverified"]
    assert closed.scheduled_tokens("b") >= LENGTH  # recomputed, not served


def test_table_bounded_oldest_dropped(model_dir: str, tmp_path: Path) -> None:
    """R147, R141: the table holds at most its limit (reported as a gauge);
    past it the oldest entries go: a prefix whose first two entries were
    dropped is unverified for those two, its other blocks still checked
    (bugs: the table counting past its limit; a reused slot answering for
    the hash it held before, a false mismatch)."""
    engine = engine_for(model_dir, tmp_path, "bounded", limit=6)
    a, b, c = prompt(6), prompt(7), prompt(8)
    for name, tokens in (("a", a), ("b-first", b), ("c", c)):
        run(engine, name, tokens)
    table = prefix_hit_verifier(engine.scheduler).external.loads.table
    assert table.count == 6 and len(table.slot_of) <= 2 * 6
    assert engine.checksums.stats.external_entries == 6
    assert engine.scheduler.reset_prefix_cache()
    # b's blocks 0 and 1 took slots 4 and 5, c's last two took them over.
    run(engine, "b", b)
    assert statuses(engine) == ["unverified"]
    verdict = engine.verdicts[0]
    assert verdict.compared_groups == [0] and not verdict.mismatches
    assert verdict.reasons == [(UnverifiedReason.NO_ENTRY, "2 of 4 loaded blocks")]
    # A's entries all went: nothing of it is checked.
    assert engine.scheduler.reset_prefix_cache()
    run(engine, "a2", a)
    assert engine.verdicts[1].reasons[0][1] == "4 of 4 loaded blocks"
    assert not engine.verdicts[1].compared_groups


def test_partial_entries_still_catch_corruption(model_dir: str, tmp_path: Path) -> None:
    """R147: with some entries dropped, a corrupted block that still has one
    is a mismatch at its position (bug: only the leading run of blocks with
    entries checked)."""
    engine = engine_for(model_dir, tmp_path, "partial", limit=6)
    b, c = prompt(9), prompt(10)
    corrupt_file_when_stored(engine, lambda kv: _flip(kv, 3 * BS + 1))
    run(engine, "b-first", b)
    run(engine, "c", c)  # takes over b's first two slots
    assert engine.scheduler.reset_prefix_cache()
    run(engine, "b", b)
    assert statuses(engine)[0] == "mismatch"
    assert engine.verdicts[0].mismatches == {0: [3]}


def made_worker(engine: SimEngine, worker: SimWorker) -> KVChecksumWorker | None:
    """The checksum worker the ActiveKVConnector creates over `worker`'s caches
    (`create_kv_checksum_worker`, which the plugin's hook and the series call
    alike); the simulated engines build theirs directly."""
    return create_kv_checksum_worker(
        engine.vllm_config,
        engine.scheduler.kv_cache_config,
        worker.caches,
        torch.device("cpu"),
        tp_rank=worker.tp_rank,
        pp_rank=worker.pp_rank,
    )


def test_worker_factory_keeps_slots_with_the_flag(
    model_dir: str, tmp_path: Path
) -> None:
    """R147, R140: with the flag, the checksum worker a real engine creates
    records entries of cached blocks and keeps exactly the configured number
    of slots (bugs: slots not allocated by the factory, so every external
    load has no entry and is unverified; the limit ignored, so the table and
    the slots disagree on positions)."""
    engine = engine_for(model_dir, tmp_path, "factory", limit=7)
    for worker in engine.workers:
        made = made_worker(engine, worker)
        assert made is not None and made.external_entries is not None
        assert tuple(made.external_entries.shape) == (7,)
        assert made.block_table.prefix_groups


def test_flag_off_attaches_nothing(model_dir: str, tmp_path: Path) -> None:
    """R147, R1: without the flag checksums stay off for ExampleConnector (it
    declares no carrier) and a carrier connector's engine keeps no entry
    table, asks workers for no entry move and allocates no slots (bugs:
    external-load state attached whatever the flag; the carrier requirement
    waived without the flag)."""
    engine = engine_for(model_dir, tmp_path, "off", flag=False)
    assert engine.checksums is None
    computed_then_loaded(engine, prompt(11))
    assert engine.scheduled_tokens("b") == LENGTH - PREFIX  # vLLM as usual
    # A carrier connector's engine with prefix-hit verification on: entries
    # recorded, but none kept for external loads.
    side = SideConfig(num_blocks=48, connector_extra={VERIFY_PREFIX_HITS_KEY: True})
    carrier = SimEngine(model_dir, side, "carrier-off")
    assert carrier.checksums is not None
    assert prefix_hit_verifier(carrier.scheduler).external is None
    for worker in carrier.workers:
        made = made_worker(carrier, worker)
        assert made is not None and made.external_entries is None
        assert made.block_table.prefix_groups  # entries for prefix hits
    run(carrier, "a", prompt(12))
    metas = [o.kv_checksum_scheduled for o in carrier.history]
    assert any(m is not None and m.blocks_to_save for m in metas)
    for meta in metas:
        assert meta is None or (
            meta.entries_to_keep is None and meta.entries_to_restore is None
        )


def test_entry_table_fifo_reference() -> None:
    """R147: the table against a plain reference (an ordered dict of the
    last `limit` new hashes): duplicates get one slot, known hashes keep
    theirs, evicted hashes answer -1 even while their stale dict item is
    left (bug: a stale item answering with a slot another hash now owns)."""
    limit = 5
    table = ExternalEntryTable(limit)
    reference: dict[bytes, None] = {}
    rng = random.Random(0)
    for _ in range(200):
        hashes = [bytes([rng.randrange(12)]) * 32 for _ in range(rng.randrange(6))]
        index, slots = table.add(hashes)
        new = [h for h in dict.fromkeys(hashes) if h not in reference]
        for h in new:
            reference[h] = None
        while len(reference) > limit:
            del reference[next(iter(reference))]
        assert sorted(hashes[i] for i in index.tolist()) == sorted(new)
        probe = [bytes([i]) * 32 for i in range(12)]
        found = table.lookup(probe)
        assert [bool(s >= 0) for s in found] == [h in reference for h in probe]
        assert len(set(found[found >= 0].tolist())) == len(reference)
        assert table.count == len(reference) and len(table.slot_of) <= 2 * limit


def _flip(kv: torch.Tensor, token: int) -> torch.Tensor:
    kv.view(torch.uint8)[token].view(-1)[0] ^= 0x5A
    return kv


def _zero_from(kv: torch.Tensor, token: int) -> torch.Tensor:
    kv[token:] = 0
    return kv


def offload_engine(
    model_dir: str, name: str, faults: bool = False, tier_checks: bool = False
) -> Any:
    """vLLM's OffloadingConnector (CPU backend, async loads) whose own entry
    checks are off, as after an error in its checksum side (R134): its loads
    are then external loads, judged against this engine's entries. With
    `tier_checks` its tier checks them itself."""
    from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
        OffloadSimEngine,
    )
    from vllm.distributed.kv_transfer.kv_checksum.config import HOST_FAULT_KEY

    extra: dict[str, Any] = {
        "cpu_bytes_to_use": 1 << 22,
        VERIFY_EXTERNAL_LOADS_KEY: True,
    }
    if faults:
        extra[HOST_FAULT_KEY] = {"rate": 1.0, "kinds": ["host_bit_flip"]}
    side = SideConfig(
        num_blocks=24,
        policy="recompute",
        connector="OffloadingConnector",
        connector_extra=extra,
    )
    engine = OffloadSimEngine(model_dir, side, name)
    if not tier_checks:
        engine.checksums.offload.off_sources.add("host")
    for worker in engine.workers:
        worker.checksum.enable_external_entries(DEFAULT_EXTERNAL_ENTRY_LIMIT)
    return engine


def test_async_loads_checked_before_use(model_dir: str) -> None:
    """R147, R119: loads that finish asynchronously (WAITING_FOR_REMOTE_KVS)
    and that no other path checks are verified in the step their request
    first runs; a host copy with a flipped bit is a mismatch and the request
    recovers (bugs: async loads never noted, only sync ones checked; a load
    its tier checks counted again as external)."""
    from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
        run_shared_prefixes,
    )

    engine = offload_engine(model_dir, "async-clean")
    run_shared_prefixes(engine, 14)
    counts = dict(engine.checksums.stats.external_loads)
    assert engine.num_loads >= 6
    assert counts == {"verified": engine.num_loads}, counts
    assert not engine.checksums.stats.loads  # no offload-tier verdict
    faulty = offload_engine(model_dir, "async-faulty", faults=True)
    run_shared_prefixes(faulty, 14)
    counts = dict(faulty.checksums.stats.external_loads)
    assert faulty.num_loads >= 1 and counts == {"mismatch": faulty.num_loads}
    assert len(faulty.final) == 14
    # A load its tier checks is not checked again as an external load.
    tier = offload_engine(model_dir, "async-tier", tier_checks=True)
    run_shared_prefixes(tier, 8)
    assert tier.num_loads >= 1 and not tier.checksums.stats.external_loads
    assert dict(tier.checksums.stats.loads) == {"verified": tier.num_loads}


def test_error_turns_verification_off_without_a_verdict(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R134, R147: an error in external-load scheduling after a check was
    registered turns external-load and prefix-hit verification off: no
    verdict is given for that check and the request runs as vLLM runs it
    (bug: only the external side turned off, so the check, left without
    its entry moves, is judged anyway)."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
        KVChecksumPrefixHits,
    )

    def broken(self: Any, block_ids: Any) -> None:
        raise RuntimeError("injected into external-load scheduling")

    monkeypatch.setattr(KVChecksumPrefixHits, "skip_saves", broken)
    engine = engine_for(model_dir, tmp_path, "guard")
    computed_then_loaded(engine, prompt(13))
    assert engine.verdicts == []
    assert prefix_hit_verifier(engine.scheduler) is None
    assert engine.scheduled_tokens("b") == LENGTH - PREFIX
    assert engine.final["b"].finish_reason is not None
