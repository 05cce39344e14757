# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fault-free loads verify and every bit flip is caught, across the matrix (R135).

Issue 13 found 221 of 1,500 fault-free loads unverified across producer /
consumer layouts and block sizes, so fail-closed failed healthy requests. This
module runs real P/D loads (`kv_checksum_pd.SimEngine`: real vLLM schedulers
with the plugin's hooks, real checksum workers over CPU KV) over the cells

    producer (TP, PP) x consumer (TP, PP) in {(1,1), (2,1), (1,2), (2,2), (4,1)}
    x block sizes (producer / consumer) 16/16, 16/32, 32/16
    x models: full attention, sliding window, both groups (hybrid)

with random prompts, random local prefix hits on the consumer (its own KV,
computed with another salt, so only loaded blocks may be compared) and both
the whole-prompt (0.33.0 NIXL pull) and the all-but-last-token connectors.
Every fault-free load must be verified; the only exception allowed is a load
holding nothing comparable, counted per reason (none occurred in any run).
Then, on the loaded blocks, single-bit flips in a random byte of a random
token slot, head, layer and worker: each must be a mismatch at exactly its
block position. A flip is verified with the consumer's real workers and the
scheduler's comparison (`verify_load`) against the producer's real payload,
so thousands of flips cost no new engine.

CI runs a fixed sample of cells. With KV_CHECKSUM_FULL=1 every cell runs
several loads (at least 1,000 loads and 10,000 flips in all) and a summary
line is printed (the guide records it).

MLA (issue 29): the same cells with one latent cache per layer
(`[blocks, 1, tokens, kv_lora_rank + qk_rope_head_dim]`, vLLM 0.33.0's MLA
layout), which every TP rank holds whole. Flips go to a random rank's
replica, so each replica is checked. What a wrong-rank read of a replicated
latent looks like, and what of it can be detected, is tested by
`test_mla_wrong_rank_reads`.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    WHOLE_PROMPT_CONNECTOR_NAME,
    SideConfig,
    SimEngine,
    consume,
    per_group,
    produce,
    run_local,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumWorkerReport,
    verify_load,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

FULL = os.environ.get("KV_CHECKSUM_FULL") == "1"
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]
BLOCK_SIZES = [(16, 16), (16, 32), (32, 16)]
KINDS = ["full", "sliding", "both"]
CELLS = list(itertools.product(LAYOUTS, LAYOUTS, BLOCK_SIZES, KINDS))
# CI: 27 cells, three layout pairs for every block-size pair and model kind.
SAMPLE = [
    cell
    for i, cell in enumerate(CELLS)
    if (i * 7919) % len(CELLS) < 27  # a fixed spread over the matrix
]
MLA_CELLS = list(itertools.product(LAYOUTS, LAYOUTS, BLOCK_SIZES, ["mla"]))
# CI: 9 MLA cells, a fixed spread as above.
MLA_SAMPLE = [
    cell for i, cell in enumerate(MLA_CELLS) if (i * 7919) % len(MLA_CELLS) < 9
]
LOADS_PER_CELL = 5 if FULL else 1
FLIPS_PER_LOAD = 10 if FULL else 6
MAX_PROMPT = 200


@dataclass
class Tally:
    """What the cells run so far did (printed by test_matrix_summary)."""

    loads: int = 0
    verified: int = 0
    flips: int = 0
    caught: int = 0
    local_hits: int = 0
    # Loads holding nothing comparable (the one allowed kind, see below).
    nothing_comparable: int = 0
    unverified: collections.Counter = field(default_factory=collections.Counter)


TALLY = Tally()


def _engines(model_dir: str, cell, connector: str) -> tuple[SimEngine, SimEngine]:
    (p_tp, p_pp), (c_tp, c_pp), (p_bs, c_bs), kind = cell
    producer = SideConfig(tp=p_tp, pp=p_pp, block_size=p_bs, groups=kind)
    consumer = SideConfig(
        tp=c_tp, pp=c_pp, block_size=c_bs, groups=kind, kv_salt=1, connector=connector
    )
    return SimEngine(model_dir, producer, "P"), SimEngine(model_dir, consumer, "D")


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 990, size=length)]


def _consumer_reports(consumer: SimEngine, req_id: str, blocks) -> dict:
    """Every consumer worker's report of the load, recomputed now (R48, R54)."""
    reports = {}
    for worker in consumer.workers:
        worker.checksum.bind(KVChecksumScheduled(reqs_to_recv={req_id: blocks}))
        record = worker.checksum.post_forward({req_id}).finalize()
        report = KVChecksumWorkerReport.from_record(record, req_id)
        assert report is not None
        reports[(worker.pp_rank, worker.tp_rank)] = report
    return reports


def _flip_targets(
    consumer: SimEngine,
    blocks,
    rng: np.random.Generator,
    exclude: dict,
    sent: dict[int, tuple[int, int]],
) -> Iterator[tuple[torch.Tensor, tuple, int, int]]:
    """Random (byte view, cell index, group, position) of loaded token slots
    the producer sent (`sent`: group -> token range; a sliding-window block
    may start before the producer's kept window, and its earlier tokens were
    never transferred), outside the positions in `exclude`."""
    bs = consumer.side.block_size
    candidates = [
        (group, i)
        for group, (start, ids) in sorted(blocks.groups.items())
        for i in range(len(ids))
        if start + i not in exclude.get(group, ())
    ]
    while candidates:
        group, i = candidates[int(rng.integers(len(candidates)))]
        start, ids = blocks.groups[group]
        position = start + i
        low, high = sent[group]
        first = max(0, low - position * bs)
        valid = min(bs, blocks.num_tokens - position * bs, high - position * bs)
        worker = consumer.workers[int(rng.integers(len(consumer.workers)))]
        names = [n for n, (_, _, g) in worker.layers.items() if g == group]
        if not names or valid <= first:
            continue
        cache = worker.caches[names[int(rng.integers(len(names)))]].view(torch.uint8)
        slot = int(rng.integers(first, valid))
        row, slot = consumer._cell_index(cache, int(ids[i]), slot)
        head = int(rng.integers(cache.shape[1]))
        byte = int(rng.integers(cache.shape[-1]))
        yield cache, (row, head, slot, byte), group, position


def _check_flips(
    consumer: SimEngine, req_id: str, payload: KVChecksumPayload, seed: int
) -> None:
    """R92, R135: each single-bit flip in a loaded block mismatches at exactly
    its group and position.

    The request has run on since its load was verified: after a whole-prompt
    load vLLM recomputes the last prompt token locally (another salt here),
    so that token's block may now differ from the producer's. The baseline
    verdict may show exactly those blocks; flips go elsewhere and must add
    exactly their own position."""
    blocks = consumer.recv_blocks(req_id)
    kcs = consumer.checksums

    def verify():
        return verify_load(
            payload,
            None,
            _consumer_reports(consumer, req_id, blocks),
            blocks,
            kcs.num_workers,
            kcs.tp_size,
            kcs.group_infos,
        )

    baseline = verify().mismatches
    last_token = (blocks.num_tokens - 1) // consumer.side.block_size
    assert all(p == [last_token] for p in baseline.values()), baseline
    rng = np.random.default_rng(seed)
    # A load of N - 1 tokens of an N-token prompt leaves its last, partial
    # 16-token chunk uncompared (R90: the two sides hold other token counts
    # in it); flips go to tokens both sides hold in full chunks.
    comparable = blocks.num_tokens
    if comparable != payload.num_tokens:
        comparable -= comparable % 16
    sent = {
        g.group_id: (
            g.start * g.chunk_tokens,
            min((g.start + len(g.values)) * g.chunk_tokens, comparable),
        )
        for g in payload.groups
    }
    targets = _flip_targets(consumer, blocks, rng, baseline, sent)
    for cache, index, group, position in itertools.islice(targets, FLIPS_PER_LOAD):
        mask = 1 << int(rng.integers(8))
        cache[index] ^= mask
        try:
            verdict = verify()
        finally:
            cache[index] ^= mask
        TALLY.flips += 1
        expected = {g: list(p) for g, p in baseline.items()}
        expected[group] = sorted({*expected.get(group, ()), position})
        assert verdict.status is KVChecksumStatus.MISMATCH, (group, position, verdict)
        assert verdict.mismatches == expected, (group, position)
        TALLY.caught += 1


def _run_cell(model_dir: str, cell, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for load in range(LOADS_PER_CELL):
        connector = (WHOLE_PROMPT_CONNECTOR_NAME, CARRIER_CONNECTOR_NAME)[load % 2]
        producer, consumer = _engines(model_dir, cell, connector)
        length = int(rng.integers(17, MAX_PROMPT))
        prompt = _prompt(rng, length)
        # A random local prefix hit: the consumer computed a request sharing
        # the first `shared` tokens (its own KV, another salt); at least two
        # prompt tokens stay to be loaded.
        shared = int(rng.integers(0, length - 1))
        if shared >= consumer.side.block_size:
            run_local(consumer, "local", prompt[:shared] + _prompt(rng, 5))
        params = produce(producer, "r", prompt)
        result = consume(consumer, producer, "r", prompt, params)
        TALLY.loads += 1
        TALLY.local_hits += result.num_local_tokens > 0
        loads = dict(consumer.checksums.stats.loads)
        if _holds_nothing_comparable(consumer, result, len(prompt)):
            # R90: every loaded token lies in the last, partial 16-token chunk,
            # which holds one token less than the producer's (a load of N - 1
            # tokens): unverified "a group has no block in common".
            assert loads == {"unverified": 1}, loads
            reasons = dict(consumer.checksums.stats.unverified_reasons)
            assert list(reasons) == ["a group has no block in common"], reasons
            TALLY.nothing_comparable += 1
            continue
        if loads.get("verified") != 1:
            reasons = dict(consumer.checksums.stats.unverified_reasons)
            TALLY.unverified.update(reasons)
            raise AssertionError(
                f"{cell} load {load}: {loads}, {reasons}, prompt {length}, "
                f"local hit {result.num_local_tokens}, {connector}"
            )
        TALLY.verified += 1
        payload = KVChecksumPayload.from_base64(params[KV_TRANSFER_PARAMS_KEY])
        _check_flips(consumer, "r", payload, seed * 100 + load)


def _holds_nothing_comparable(consumer: SimEngine, result, prompt_len: int) -> bool:
    """Whether the load's tokens all lie in a partial last chunk that the two
    sides fill differently (the consumer loaded N - 1 of N prompt tokens)."""
    end = result.num_local_tokens + result.num_loaded_tokens
    return end != prompt_len and result.num_local_tokens >= end - end % 16


def _cell_id(cell) -> str:
    (p_tp, p_pp), (c_tp, c_pp), (p_bs, c_bs), kind = cell
    return f"P{p_tp}x{p_pp}-D{c_tp}x{c_pp}-bs{p_bs}to{c_bs}-{kind}"


@pytest.mark.parametrize("cell", CELLS if FULL else SAMPLE, ids=_cell_id)
def test_fault_free_loads_verify_and_flips_are_caught(model_dir: str, cell) -> None:
    """R134-R135 (issue 13): in every cell of the matrix a fault-free load,
    after a random local prefix hit, is verified (not unverified "the first
    loaded block starts inside a producer block" or "a group has no block in
    common"), and single-bit flips in loaded blocks mismatch at exactly their
    position. Fails with producers sending per block (v1): consumers with
    16-token blocks after odd prefix hits, and sliding-window clips starting
    at an odd 16-token block, are then unverified."""
    _run_cell(model_dir, cell, CELLS.index(cell))


@pytest.mark.parametrize("cell", MLA_CELLS if FULL else MLA_SAMPLE, ids=_cell_id)
def test_mla_fault_free_loads_verify_and_flips_are_caught(model_dir: str, cell) -> None:
    """R32, R91, R134-R135 (issue 29) for MLA: in every TP/PP x block-size
    cell a fault-free load of replicated latent caches is verified, and a
    single-bit flip in any rank's replica mismatches at exactly its position.
    Fails if MLA latents were numbered as sharded heads (rank r's copy taken
    for head r: replica-0 totals then miss layers, "replica key missing", or
    the producer folds TP copies into one sum) or if only rank 0's replica
    were checksummed (flips on other ranks pass)."""
    _run_cell(model_dir, cell, len(CELLS) + MLA_CELLS.index(cell))


def test_matrix_summary() -> None:
    """Prints the figures of the cells run before it (the guide records a
    full run); it asserts only that every fault-free load verified."""
    print(
        f"\nmatrix: {TALLY.loads} fault-free loads, {TALLY.verified} verified, "
        f"{TALLY.nothing_comparable} holding nothing comparable, "
        f"{TALLY.local_hits} with a local prefix hit, unverified by reason "
        f"{dict(TALLY.unverified)}; {TALLY.flips} single-bit flips, "
        f"{TALLY.caught} caught at their position"
    )
    assert TALLY.verified + TALLY.nothing_comparable == TALLY.loads
    assert TALLY.caught == TALLY.flips


# ----------------------------------------------------------------------
# MLA: wrong-rank reads of a replicated latent cache (issue 29)
# ----------------------------------------------------------------------

WRONG_READS = (
    "other_block",  # the rank copied another loaded block of the request
    "other_layer",  # the rank copied another layer's latent (wrong stage/layer)
    "unloaded_block",  # the rank read a block outside the load (stale bytes)
    "other_replica",  # the rank copied the block from another rank (same bytes)
    "divergent_producer_replica",  # ... from a producer rank whose copy differs
)


def _block_rows(engine: SimEngine, cache: torch.Tensor, block: int) -> slice:
    """The rows of `cache` (a [rows, heads, tokens, bytes] view) of one block."""
    split = engine.side.block_size // cache.shape[2]
    return slice(block * split, (block + 1) * split)


@pytest.mark.parametrize("read", WRONG_READS)
@pytest.mark.parametrize(("p_tp", "c_tp"), [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_mla_wrong_rank_reads(model_dir: str, read: str, p_tp: int, c_tp: int) -> None:
    """R32, R91 (issue 29): with MLA every rank holds the same latent bytes
    for a block, so a consumer rank reading the right block from another
    producer rank ("other_replica") gets identical bytes: nothing to detect
    and nothing wrong, and the load stays verified. Every wrong read that
    changes bytes of one rank's replica is a mismatch at exactly that block
    position: another block of the load, another layer's latent, a block
    outside the load (a stale read), or the right block from a producer rank
    whose copy diverged from the producer's rank 0 (the producer checksums
    replica 0 only; it never compares its own replicas, so a divergent
    producer copy that no consumer reads goes unnoticed).

    Fails if MLA latents were numbered as sharded heads (a TP 4 producer and
    a TP 2 consumer then disagree on every slice), or if a consumer
    checksummed only the ranks holding replica 0 (a wrong read on another
    rank passes)."""
    if read == "divergent_producer_replica" and p_tp == 1:
        pytest.skip("a producer with one rank has no other replica")
    rng = np.random.default_rng(WRONG_READS.index(read) * 100 + p_tp * 10 + c_tp)
    producer = SimEngine(model_dir, SideConfig(tp=p_tp, groups="mla"), "P")
    consumer = SimEngine(
        model_dir,
        SideConfig(
            tp=c_tp, groups="mla", kv_salt=1, connector=WHOLE_PROMPT_CONNECTOR_NAME
        ),
        "D",
    )
    prompt = _prompt(rng, 100)  # 7 blocks of 16, the last one partial
    params = produce(producer, "r", prompt)
    result = consume(consumer, producer, "r", prompt, params)
    assert dict(consumer.checksums.stats.loads) == {"verified": 1}
    payload = KVChecksumPayload.from_base64(params[KV_TRANSFER_PARAMS_KEY])
    blocks = consumer.recv_blocks("r")
    assert blocks is not None
    kcs = consumer.checksums

    def verify():
        reports = _consumer_reports(consumer, "r", blocks)
        return verify_load(
            payload, None, reports, blocks, kcs.num_workers, kcs.tp_size,
            kcs.group_infos,
        )  # fmt: skip

    baseline = verify().mismatches
    start, ids = blocks.groups[0]
    assert start == 0 and result.num_local_tokens == 0
    position, other = 2, 4  # full blocks, neither the recomputed last one
    rank = consumer.workers[-1]  # the last rank: a replica other than 0
    names = sorted(rank.caches)
    layer = names[1]
    cache = rank.caches[layer].view(torch.uint8)
    mine = _block_rows(consumer, cache, int(ids[position]))
    saved = cache[mine].clone()
    if read == "other_block":
        cache[mine] = cache[_block_rows(consumer, cache, int(ids[other]))]
    elif read == "other_layer":
        theirs = rank.caches[names[2]].view(torch.uint8)
        cache[mine] = theirs[_block_rows(consumer, theirs, int(ids[position]))]
    elif read == "unloaded_block":
        used = {int(b) for b in ids} | {consumer.null_block}
        free = next(b for b in range(consumer.side.num_blocks) if b not in used)
        cache[mine] = cache[_block_rows(consumer, cache, free)].clone()
    else:
        source = producer.workers[-1]
        theirs = source.caches[layer].view(torch.uint8)
        remote = per_group(params["remote_block_ids"])[0][position]
        rows = theirs[_block_rows(producer, theirs, remote)].clone()
        if read == "divergent_producer_replica":
            rows[0, 0, int(rng.integers(16)), int(rng.integers(rows.shape[-1]))] ^= 1
        cache[mine] = rows
    try:
        verdict = verify()
    finally:
        cache[mine] = saved
    if read == "other_replica":
        assert torch.equal(rows, saved)
        assert verdict.mismatches == baseline
        return
    expected = {g: list(p) for g, p in baseline.items()}
    expected[0] = sorted({*expected.get(0, ()), position})
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == expected
