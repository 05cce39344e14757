# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifying local prefix-cache hits (R140) on vLLM 0.33.0's real Scheduler,
KV cache manager and block pool, with real checksum workers over CPU KV caches
(`kv_checksum_pd.SimEngine`: each step's forward writes a deterministic KV per
token and position).

Every fault below is one the issue cites: a cached block overwritten after
caching, a prefix-cache key pointing at another block, a freed-and-reused
block whose old hash survived. Each must be caught when a later request hits
it, and that request recomputed from the first bad block.
"""

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    make_request,
    prefix_hit_verifier,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig, SimEngine
from vllm.distributed.kv_transfer.kv_checksum.config import (
    FAULT_INJECTION_KEY,
    FAULT_KINDS,
    PREFIX_HIT_FAULT,
    VERIFY_PREFIX_HITS_KEY,
    read_fault_injection,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    KVChecksumPrefixHits,
)
from vllm.distributed.kv_transfer.kv_checksum.faults.injector import KVFaultInjector

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.usefixtures("cuda_stream_stubs"),
    pytest.mark.kv_checksum_capability("prefix_hits"),
]

BS = 16
PREFIX = 4 * BS


def engine_for(
    model_dir: str, name: str, num_blocks: int = 48, pp: int = 1
) -> SimEngine:
    side = SideConfig(
        num_blocks=num_blocks,
        pp=pp,
        policy="recompute",
        connector_extra={VERIFY_PREFIX_HITS_KEY: True},
    )
    engine = SimEngine(model_dir, side, name)
    for worker in engine.workers:  # as the ActiveKVConnector hook does
        worker.checksum.enable_prefix_entries()
    return engine


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def run(engine: SimEngine, req_id: str, tokens: list[int]) -> Any:
    request = make_request(req_id, tokens, max_tokens=1, block_size=BS)
    engine.add(request)
    engine.run(req_id)
    return request


def prefix_verdicts(engine: SimEngine) -> dict[str, int]:
    return dict(engine.checksums.stats.prefix_hits)


def cached_block(engine: SimEngine, request: Any, position: int) -> Any:
    """The block vLLM's prefix cache maps the request's hash at `position` to."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    blocks = pool.get_cached_block(request.block_hashes[position], [0])
    return None if blocks is None else blocks[0]


def flip_byte(engine: SimEngine, block_id: int, stage: int | None = None) -> None:
    """Corrupt one KV byte of `block_id` on every worker (of PP stage `stage`)."""
    for worker in engine.workers:
        if stage is not None and worker.pp_rank != stage:
            continue
        cache = next(iter(worker.caches.values())).view(torch.uint8)
        cache[block_id].view(-1)[0] ^= 0x5A


def hits_state(engine: SimEngine) -> Any:
    return prefix_hit_verifier(engine.scheduler).hits


def test_flag_is_boolean() -> None:
    """R140, R8: a non-boolean flag is a start-up error (bug: any truthy
    value silently accepted)."""

    class Config:
        kv_connector_extra_config = {VERIFY_PREFIX_HITS_KEY: "yes"}

    with pytest.raises(ValueError, match=VERIFY_PREFIX_HITS_KEY):
        read_flags(Config())
    Config.kv_connector_extra_config = {VERIFY_PREFIX_HITS_KEY: True}
    assert read_flags(Config()).verify_prefix_hits


def test_clean_hits_verified(model_dir: str) -> None:
    """R140: a clean hit is verified, not mismatched (bug: entries recorded
    with another position's hash or before the forward wrote the block)."""
    engine = engine_for(model_dir, "clean")
    base = prompt(1, PREFIX + 5)
    run(engine, "a", base)
    run(engine, "c", base[:PREFIX] + [7, 7, 7])
    run(engine, "d", base[:PREFIX] + [8, 8, 8])
    assert prefix_verdicts(engine) == {"verified": 2}
    # Hits were actually used: c computed only its 3 new tokens.
    assert engine.scheduled_tokens("c") == 3


def test_overwritten_block_caught_and_recomputed(model_dir: str) -> None:
    """R140 (a): a cached block overwritten after caching (tenstorrent #415,
    "token salad") is caught at the next hit; the request recomputes from
    that block and the block leaves the prefix cache (bug: hits served
    unchecked, or the check run before the entry was saved)."""
    engine = engine_for(model_dir, "overwritten")
    base = prompt(2, PREFIX + 5)
    a = run(engine, "a", base)
    bad = cached_block(engine, a, 2)
    cache = next(iter(engine.workers[0].caches.values())).view(torch.uint8)
    clean = cache[bad.block_id].clone()
    flip_byte(engine, bad.block_id)
    tail = [7, 7, 7]
    run(engine, "c", base[:PREFIX] + tail)
    # The bad hit, then (restarted) a clean hit of blocks 0-1, checked again.
    assert prefix_verdicts(engine) == {"mismatch": 1, "verified": 1}
    # First step: 3 new tokens on the bad hit; then recomputed from block 2.
    assert engine.scheduled_tokens("c") == len(tail) + (PREFIX - 2 * BS + len(tail))
    again = cached_block(engine, a, 2)  # cached again by c's recompute
    assert again.block_id != bad.block_id  # the bad block left the cache
    assert torch.equal(cache[again.block_id], clean)
    run(engine, "d", base[:PREFIX] + [8, 8, 8])
    assert prefix_verdicts(engine) == {"mismatch": 1, "verified": 2}


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_hits_of_pp_stages_checked_each_by_its_own_fingerprint(
    model_dir: str, corrupt: bool
) -> None:
    """R140, R120: at PP 2 each stage's worker records its hit entries with
    its own fingerprint (its own layers); a clean hit verifies, and a cached
    block corrupted on the second stage alone is a mismatch, recomputed from
    that block.

    Bug caught: verification reusing the first worker's fingerprint tags for
    every worker (`offload/entries.py`): the second stage's entries never
    match, so every clean hit mismatches and is recomputed."""
    engine = engine_for(model_dir, "pp-stages", pp=2)
    stages = {w.pp_rank: w.checksum.fingerprints[0] for w in engine.workers}
    assert len(stages) == 2 and stages[0] != stages[1]
    base = prompt(21, PREFIX + 5)
    a = run(engine, "a", base)
    if corrupt:
        flip_byte(engine, cached_block(engine, a, 2).block_id, stage=1)
    tail = [7, 7, 7]
    run(engine, "c", base[:PREFIX] + tail)
    if corrupt:  # the bad hit, then (restarted) a clean hit of blocks 0-1
        assert prefix_verdicts(engine) == {"mismatch": 1, "verified": 1}
        assert engine.scheduled_tokens("c") == 2 * len(tail) + PREFIX - 2 * BS
    else:
        assert prefix_verdicts(engine) == {"verified": 1}
        assert engine.scheduled_tokens("c") == len(tail)


def test_key_pointing_at_another_block_caught(model_dir: str) -> None:
    """R140 (b): a prefix-cache key mapping to another block (vLLM #49125,
    local-inference-lab #480: foreign KV after churn) is caught: the entry
    binds the block's KV to the hash it was cached under (bug: entries
    compared without the hash tag)."""
    engine = engine_for(model_dir, "foreign")
    base, other = prompt(3, PREFIX + 5), prompt(4, PREFIX + 5)
    a = run(engine, "a", base)
    b = run(engine, "b", other)
    mine, foreign = cached_block(engine, a, 1), cached_block(engine, b, 1)
    table = engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    key = mine.block_hash
    table.pop(key, mine.block_id)
    table.insert(key, foreign)
    run(engine, "c", base[:PREFIX] + [7, 7, 7])
    # Restarted, c's second hit (block 0 only) is checked again, not bad.
    assert prefix_verdicts(engine).get("mismatch") == 1
    assert engine.final["c"] is not None


def test_key_redirect_caught_with_tags_cached(model_dir: str) -> None:
    """R140 (b), R142 (issue 31): with both prefixes' tags already cached by
    clean hits (the tag cache holds every block's tag), a key redirected to
    the other prefix's block is still caught, and the clean hits before it
    verified.

    Bug caught: tags cached per block id (or per block) rather than per
    request hash and fingerprint; the redirected block's own cached tag
    would then make its foreign entry look right."""
    engine = engine_for(model_dir, "foreign-cached")
    base, other = prompt(13, PREFIX + 5), prompt(14, PREFIX + 5)
    a = run(engine, "a", base)
    b = run(engine, "b", other)
    run(engine, "a2", base[:PREFIX] + [5, 5, 5])  # both prefixes hit clean
    run(engine, "b2", other[:PREFIX] + [6, 6, 6])
    assert prefix_verdicts(engine) == {"verified": 2}
    assert hits_state(engine).tags.size >= 2 * (PREFIX // BS)
    mine, foreign = cached_block(engine, a, 1), cached_block(engine, b, 1)
    table = engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    table.pop(mine.block_hash, mine.block_id)
    table.insert(mine.block_hash, foreign)
    run(engine, "c", base[:PREFIX] + [7, 7, 7])
    assert prefix_verdicts(engine).get("mismatch") == 1


def test_entries_of_split_position_runs() -> None:
    """R140, R142: `on_cached` saves one run per stretch of consecutive
    positions, each with the request's hashes of its own positions, and one
    run, without splitting, for consecutive ones (the usual case); compared
    with runs cut by a plain loop.

    Bug caught: the one-run shortcut taken for positions with a gap, which
    would save every entry after the gap under another position's hash."""
    hits = KVChecksumPrefixHits(200, 0, BS, None, 1)

    class Request:
        block_hashes = [bytes([i]) * 32 for i in range(12)]

    def reference(positions: list[int]) -> list[tuple[int, list[int]]]:
        runs: list[tuple[int, list[int]]] = []
        for pos in positions:
            if runs and runs[-1][0] + len(runs[-1][1]) == pos:
                runs[-1][1].append(pos)
            else:
                runs.append((pos, [pos]))
        return runs

    for positions in ([3, 4, 5, 6], [0, 1, 3, 4, 9], [7], [2, 5, 6, 11]):
        ids = [100 + p for p in positions]
        keys = [("key", p) for p in positions]
        hits.on_cached(Request(), np.asarray(positions), np.asarray(ids), keys)
        saves = hits.take_step().saves
        expected = reference(positions)
        assert [(start, list(ids_)) for _, start, ids_, _ in saves] == [
            (start, [100 + p for p in run]) for start, run in expected
        ]
        assert [hashes for *_, hashes in saves] == [
            [Request.block_hashes[p] for p in run] for _, run in expected
        ]
        assert all(hits.entry_keys[100 + p] == ("key", p) for p in positions)
        assert hits.has_entry[ids].all()


def test_still_cached_tells_a_checked_block_from_its_reuse() -> None:
    """R140: a check's bad block is still the block that was checked until it
    leaves or re-enters the prefix cache (evicted, cached again by another
    computation, reset); only then are its holders not recovered for it.
    Bugs caught (tried): every bad block taken as gone (holders of a bad
    block still cached keep running on it); every bad block taken as still
    there (a block evicted and cached again recovers innocent holders)."""
    hits = KVChecksumPrefixHits(16, 0, BS, None, 1)

    class Request:
        request_id = "r"
        block_hashes = [bytes([i]) * 32 for i in range(4)]

    ids = np.asarray([3, 5, 7])
    hits.on_cached(Request(), np.arange(3), ids, ["k0", "k1", "k2"])
    hits.take_step()
    hits.add_hits(Request(), ids, 0)
    (key,) = hits.take_step().keys
    load = hits.pending[key]
    bad = [(0, 3), (1, 5), (2, 7)]
    assert hits.still_cached(load, bad) == {3, 5, 7}
    hits.on_evicted([5])
    assert hits.still_cached(load, bad) == {3, 7}
    hits.on_cached(Request(), np.asarray([1]), np.asarray([5]), ["k1"])
    assert hits.still_cached(load, bad) == {3, 7}
    hits.clear()
    assert hits.still_cached(load, bad) == set()


def test_reused_block_with_surviving_hash_caught(model_dir: str) -> None:
    """R140 (c): a freed block reused by another request while its old hash
    stays in the prefix cache (kvcached #362: eviction that leaves the key)
    is caught; the entry survives because the key still reaches the block
    (bug: entries dropped whenever vLLM's eviction runs)."""
    engine = engine_for(model_dir, "reused", num_blocks=7)
    pool = engine.scheduler.kv_cache_manager.block_pool
    base = prompt(5, PREFIX + 1)
    a = run(engine, "a", base)
    reused = cached_block(engine, a, 3)
    pool._remove_cached_block_hashes = lambda block: []  # the eviction bug
    b_tokens = prompt(6, 40)
    run(engine, "b", b_tokens)
    assert cached_block(engine, a, 3) is reused  # the stale key survived
    engine.add(
        make_request("c", base[:PREFIX] + [7, 7, 7], max_tokens=1, block_size=BS)
    )
    while not prefix_verdicts(engine):
        engine.step()
    assert prefix_verdicts(engine) == {"mismatch": 1}
    # vLLM's own eviction again (the broken one asserts once stale-keyed
    # blocks are filled anew): c restarts and finishes.
    del pool._remove_cached_block_hashes
    engine.run("c")
    assert prefix_verdicts(engine).get("mismatch", 0) <= 2
    assert engine.final["c"] is not None


def test_state_bounded_by_cached_blocks(model_dir: str) -> None:
    """R140, R141: after churn through a small pool, entries exist only for
    blocks the prefix cache still reaches (bug: entries of evicted blocks
    kept forever)."""
    engine = engine_for(model_dir, "bounded", num_blocks=14)
    pool = engine.scheduler.kv_cache_manager.block_pool
    prefixes = [prompt(10 + i, PREFIX) for i in range(3)]
    recorded = 0
    for i in range(24):
        run(engine, f"r{i}", prefixes[i % 3] + prompt(100 + i, BS + 1))
        recorded = max(recorded, hits_state(engine).num_entries)
        hits = hits_state(engine)
        cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert set(hits.entry_keys) <= cached
        assert int(hits.has_entry.sum()) == hits.num_entries
    counts = prefix_verdicts(engine)
    assert counts.get("mismatch", 0) == 0 and counts.get("verified", 0) > 0
    assert not hits_state(engine).pending
    assert recorded <= len(pool.blocks) - 1  # never more than cacheable blocks


def test_entries_dropped_per_call_of_vllms_eviction(model_dir: str) -> None:
    """R140, R142: entries leave with the blocks vLLM evicts by id (the
    scheduler's `evict_blocks`, as a mismatch or a connector's invalid blocks
    do) and with those it hands out again, through one hook per call of
    `get_new_blocks` / `evict_blocks`, not one per block (issue 30: the
    per-block `_maybe_evict_cached_block` wrapper cost a Python frame per
    allocated block). Bugs caught (tried): no hook on `evict_blocks` (the
    evicted blocks keep their entries); entries dropped for every block
    handed out, whether a key still reaches it or not (test above)."""
    engine = engine_for(model_dir, "evict-by-id", num_blocks=14)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert "_maybe_evict_cached_block" not in pool.__dict__
    a = run(engine, "a", prompt(50, PREFIX + 1))
    hits = hits_state(engine)
    ids = {cached_block(engine, a, i).block_id for i in range(2)}
    assert ids <= set(hits.entry_keys)
    engine.scheduler.kv_cache_manager.evict_blocks(ids)
    assert not ids & set(hits.entry_keys)
    assert not hits.has_entry[sorted(ids)].any()
    kept = set(hits.entry_keys)
    cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert kept and kept <= cached


@pytest.mark.kv_checksum_capability("plugin")  # the plugin's block-pool hook
def test_cached_blocks_read_without_a_loop_per_block() -> None:
    """R140, R142: the cache_full_blocks hook hands the listener exactly the
    blocks vLLM gave a hash in this call (vLLM's KVCacheBlock: not the null
    block, not a masked one), at their positions in the request, and the
    listener records them. Reference: the positions, ids and keys written out
    by hand. Bugs caught: positions taken as 0.. of the new blocks, or not
    thinned with the ids (the kept blocks' positions shifted), null or
    unhashed blocks recorded, another KV cache group's blocks recorded."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
        PrefixHitEntryListener,
    )
    from vllm.distributed.kv_transfer.kv_checksum.wiring import prefix_cache
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    calls: list[tuple[list[int], list[int], list[Any]]] = []

    class Hits:
        group_id = 0

        def on_cached(self, request, positions, block_ids, keys) -> None:
            calls.append((positions.tolist(), block_ids.tolist(), list(keys)))

    def block(block_id: int, key: Any, null: bool = False) -> KVCacheBlock:
        b = KVCacheBlock(block_id, is_null=null)
        if key is not None:
            b.set_block_hash(key, num_tokens=16)
        return b

    listener = PrefixHitEntryListener(Hits(), lambda: True, print)  # type: ignore[arg-type]

    def note(blocks: list, start: int, end: int, group: int = 0) -> None:
        new, positions = prefix_cache._cached_blocks(blocks, start, end)
        listener.on_blocks_cached(None, new, positions, group, 16)

    blocks = [block(7, "k0"), block(9, "k1"), block(0, None, null=True)]
    blocks += [block(4, None), block(12, "k4"), block(3, "k5")]
    note(blocks, 1, 6)
    assert calls == [([1, 4, 5], [9, 12, 3], ["k1", "k4", "k5"])]
    calls.clear()
    note(blocks, 4, 6)
    assert calls == [([4, 5], [12, 3], ["k4", "k5"])]
    calls.clear()
    note(blocks, 2, 4)
    note(blocks, 6, 6)
    note(blocks, 0, 6, group=1)
    assert calls == []


def test_entry_hook_errors_never_reach_vllm(model_dir: str) -> None:
    """R134, R140: an error in the hooks on vLLM's block pool (here: dropping
    an entry on eviction) turns prefix-hit verification off with one error
    line; vLLM's eviction and every request go on (bug: an unguarded block
    pool hook raising into vLLM's allocator)."""
    engine = engine_for(model_dir, "evict-error", num_blocks=14)
    hits = hits_state(engine)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected into on_evicted")

    hits.on_evicted = broken  # type: ignore[method-assign]
    prefixes = [prompt(40 + i, PREFIX) for i in range(3)]
    for i in range(12):  # churn through the small pool: evictions happen
        run(engine, f"e{i}", prefixes[i % 3] + prompt(140 + i, BS + 1))
    assert prefix_hit_verifier(engine.scheduler) is None


def faulted_engine(model_dir: str, name: str, rate: float, tp: int = 1) -> SimEngine:
    side = SideConfig(
        tp=tp,
        num_blocks=48,
        policy="recompute",
        connector_extra={VERIFY_PREFIX_HITS_KEY: True},
        fault_injection={"rate": rate, "kinds": [PREFIX_HIT_FAULT], "seed": 3},
    )
    engine = SimEngine(model_dir, side, name)
    for worker in engine.workers:
        worker.checksum.enable_prefix_entries()
    return engine


@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_hit_faults_all_caught(model_dir: str, tp: int) -> None:
    """R131, R140: at rate 1 every checked hit gets one flipped bit before its
    check, and each is caught: a mismatch, the request recomputed from the
    injected block, the block out of the prefix cache
    (bugs: the bit flipped after the check's checksums were queued, so the
    check passes on clean bytes; the flip at another block than the one
    logged; a hit decision that differs between TP workers). Restarted, the
    request's re-hit is checked again; at rate 1 it is faulted again, and the
    second restart must read no prefix cache (bug: restarted forever)."""
    engine = faulted_engine(model_dir, f"hit-faults-tp{tp}", 1.0, tp)
    cache = next(iter(engine.workers[0].caches.values())).view(torch.uint8)
    tail = [7, 7, 7]
    caught = 0
    for i in range(4):
        base = prompt(20 + i, PREFIX + 5)
        a = run(engine, f"a{i}", base)
        seen = len(engine.injections)
        assert seen == caught * tp  # no hit in a's run, nothing injected
        snapshot = cache.clone()
        run(engine, f"c{i}", base[:PREFIX] + tail)
        injected = engine.injections[seen:]
        # At rate 1 the restarted request's re-hit (if any) is faulted too.
        checks = [injected[j : j + tp] for j in range(0, len(injected), tp)]
        assert 1 <= len(checks) <= 2  # the second restart reads no cache
        assert len(injected) == len(checks) * tp
        for check in checks:
            # One decision on every worker; only worker TP 0 flips the bit.
            assert len({replace(inj, layers=()) for inj in check}) == 1
            assert [bool(inj.layers) for inj in check] == [True] + [False] * (tp - 1)
        inj = checks[0][0]
        assert (inj.req_id, inj.kind, inj.group_id) == (f"c{i}", "prefix_hit", 0)
        caught += len(checks)
        assert prefix_verdicts(engine) == {"mismatch": caught}
        if len(checks) == 1:  # restarted once: recomputed from the bad block
            recompute = PREFIX - inj.position * BS + len(tail)
            assert engine.scheduled_tokens(f"c{i}") == len(tail) + recompute
        # Cached again (after one restart), the position holds clean bytes.
        again = cached_block(engine, a, inj.position)
        assert again is not None or len(checks) == 2
        if again is not None:
            assert torch.equal(cache[again.block_id], snapshot[inj.block_id])


def test_prefix_hit_faults_off_at_rate_zero(model_dir: str) -> None:
    """R131, R140: at rate 0 nothing is injected and every hit verifies (bug:
    the hit decision ignoring the rate)."""
    engine = faulted_engine(model_dir, "hit-faults-off", 0.0)
    for i in range(4):
        base = prompt(30 + i, PREFIX + 5)
        run(engine, f"a{i}", base)
        run(engine, f"c{i}", base[:PREFIX] + [7, 7, 7])
        assert engine.scheduled_tokens(f"c{i}") == 3
    assert not engine.injections
    assert prefix_verdicts(engine) == {"verified": 4}


def test_prefix_hit_kind_validated_and_opt_in() -> None:
    """R131: "prefix_hit" is accepted but never a default kind, an unknown kind
    is a start-up error, and a load never gets a prefix_hit fault (bugs: the
    new kind added to the defaults, changing existing deployments; a typo
    silently accepted; loads corrupted under the hit kind)."""

    class Config:
        kv_connector_extra_config: dict = {FAULT_INJECTION_KEY: {"rate": 0.5}}

    assert read_fault_injection(Config()).kinds == FAULT_KINDS  # type: ignore[union-attr]
    Config.kv_connector_extra_config = {
        FAULT_INJECTION_KEY: {"rate": 0.5, "kinds": ["prefix_hit"]}
    }
    assert read_fault_injection(Config()).kinds == ("prefix_hit",)  # type: ignore[union-attr]
    Config.kv_connector_extra_config = {
        FAULT_INJECTION_KEY: {"rate": 0.5, "kinds": ["prefix_hits"]}
    }
    with pytest.raises(ValueError, match="kinds"):
        read_fault_injection(Config())
    load = KVChecksumBlocks(2 * BS, {0: (0, np.array([3, 4]))})
    only_hits = KVFaultInjector(1.0, ("prefix_hit",), 0)
    assert all(only_hits.decide(f"r{i}", load, 32) is None for i in range(20))
    assert all(only_hits.decide_hit(f"r{i}", load) for i in range(20))
    mixed = KVFaultInjector(1.0, ("bit_flip", "prefix_hit"), 0)
    assert {mixed.decide(f"r{i}", load, 32).kind for i in range(20)} == {"bit_flip"}  # type: ignore[union-attr]
    assert KVFaultInjector(1.0, FAULT_KINDS, 0).decide_hit("r", load) is None


def test_bad_hit_under_async_scheduling_delivers_no_token_of_it(
    model_dir: str,
) -> None:
    """R140 under async scheduling (vLLM's default), stepped as its engine
    does: the step after a request's first step on a hit is scheduled before
    the hit's verdict. A mismatch must drop that in-flight step's token too,
    so every token the request returns comes from a step after its recompute
    (bug seen on an H200: vLLM's invalid-block recovery kept the in-flight
    token, so every faulted request answered wrong from its first token)."""
    side = SideConfig(
        num_blocks=48,
        policy="recompute",
        async_scheduler=True,
        connector_extra={VERIFY_PREFIX_HITS_KEY: True},
    )
    engine = SimEngine(model_dir, side, "async-hit")
    engine.step_tokens = True
    for worker in engine.workers:
        worker.checksum.enable_prefix_entries()
    base = prompt(30, PREFIX + 5)
    a = make_request("a", base, max_tokens=1, block_size=BS)
    engine.add(a)
    engine.run_pipelined("a")
    flip_byte(engine, cached_block(engine, a, 1).block_id)
    tail = [7, 7, 7]
    c = make_request("c", base[:PREFIX] + tail, max_tokens=3, block_size=BS)
    engine.add(c)
    first = len(engine.history)
    tokens = engine.run_pipelined("c")
    assert prefix_verdicts(engine)["mismatch"] == 1
    steps = [i for i, o in enumerate(engine.history) if "c" in o.num_scheduled_tokens]
    assert steps[0] == first  # the step on the bad hit
    # The recompute: the first step after the bad one that computes more than
    # one token (from block 1 to the prompt's end).
    recompute = next(
        i for i in steps[1:] if engine.history[i].num_scheduled_tokens["c"] > 1
    )
    assert len(tokens) == 3
    assert all(t >= 1000 + recompute for t in tokens), (tokens, steps, recompute)
