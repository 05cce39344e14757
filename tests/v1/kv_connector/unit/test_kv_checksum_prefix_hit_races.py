# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-hit verification (R140) when the scheduler moves on before a
verdict: vLLM 0.33.0's real AsyncScheduler, KV cache manager and block pool,
stepped as its async engine does (step N + 1 is scheduled before step N's
output arrives), with real checksum workers over CPU KV caches
(`kv_checksum_pd.SimEngine`; each sampled token is 1000 + the index of the
step that sampled it, so a token names the step it came from).

Each test is one way a token computed over a bad hit, or a block computed
over it, could get past the check: a re-hit while the first check is in
flight, a restart that keeps derived blocks cached, vLLM's own preemption of
the checked request, a request waiting for its remote KV on a known-bad
block, and the bookkeeping once verification stops.
"""

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    consumer_kv_transfer_params,
    make_request,
    prefix_hit_verifier,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig, SimEngine
from vllm.distributed.kv_transfer.kv_checksum.config import VERIFY_PREFIX_HITS_KEY
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.usefixtures("cuda_stream_stubs"),
    pytest.mark.kv_checksum_capability("prefix_hits"),
]

BS = 16
PREFIX = 4 * BS
Step = tuple[Any, Any]


def async_engine(
    model_dir: str,
    name: str,
    policy: str = "recompute",
    num_blocks: int = 48,
    kv_role: str = "kv_both",
    max_num_seqs: int | None = None,
) -> SimEngine:
    side = SideConfig(
        num_blocks=num_blocks,
        policy=policy,
        async_scheduler=True,
        kv_role=kv_role,
        max_num_seqs=max_num_seqs,
        connector_extra={VERIFY_PREFIX_HITS_KEY: True},
    )
    engine = SimEngine(model_dir, side, name)
    engine.step_tokens = True
    for worker in engine.workers:  # as the ActiveKVConnector hook does
        worker.checksum.enable_prefix_entries()
    return engine


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def add(engine: SimEngine, req_id: str, tokens: list[int], **kwargs: Any) -> Any:
    request = make_request(req_id, tokens, block_size=BS, **kwargs)
    engine.add(request)
    return request


def cache_prefix(engine: SimEngine, tokens: list[int]) -> Any:
    """Run request "a" over `tokens` to its end: its full blocks are cached."""
    a = add(engine, "a", tokens, max_tokens=1)
    engine.run_pipelined("a")
    return a


def cached_block_id(engine: SimEngine, request: Any, position: int) -> int | None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    blocks = pool.get_cached_block(request.block_hashes[position], [0])
    return None if blocks is None else blocks[0].block_id


def flip_byte(engine: SimEngine, block_id: int) -> None:
    """Corrupt one KV byte of `block_id` on every worker."""
    for worker in engine.workers:
        cache = next(iter(worker.caches.values())).view(torch.uint8)
        cache[block_id].view(-1)[0] ^= 0x5A


def kv_of(engine: SimEngine, block_id: int) -> torch.Tensor:
    """A copy of `block_id`'s KV bytes on worker 0."""
    cache = next(iter(engine.workers[0].caches.values())).view(torch.uint8)
    return cache[block_id].clone()


def schedule(engine: SimEngine, in_flight: list[Step]) -> Any:
    """Schedule and run the next step; its output stays in flight."""
    in_flight.append(engine.forward())
    return in_flight[-1][0]


def process(engine: SimEngine, in_flight: list[Step]) -> None:
    """The oldest step's output reaches the scheduler."""
    engine.update(*in_flight.pop(0))


def run_all(
    engine: SimEngine,
    in_flight: list[Step],
    req_ids: list[str],
    after_schedule: Callable[[Any], None] | None = None,
    max_steps: int = 60,
) -> None:
    """Step as vLLM's async engine does until every request finished."""
    for _ in range(max_steps):
        if all(r in engine.final for r in req_ids):
            break
        output = schedule(engine, in_flight)
        if after_schedule is not None:
            after_schedule(output)
        while len(in_flight) > 1:
            process(engine, in_flight)
    while in_flight:
        process(engine, in_flight)
    assert all(r in engine.final for r in req_ids), engine.final.keys()


def prefix_verdicts(engine: SimEngine) -> dict[str, int]:
    return dict(engine.checksums.stats.prefix_hits)


def steps_of(engine: SimEngine, req_id: str) -> list[int]:
    return [i for i, o in enumerate(engine.history) if req_id in o.num_scheduled_tokens]


def is_cached(engine: SimEngine, block_id: int) -> bool:
    pool = engine.scheduler.kv_cache_manager.block_pool
    return pool.blocks[block_id].block_hash is not None


def test_rehit_while_first_check_in_flight_is_judged(model_dir: str) -> None:
    """R140 under async scheduling: request c, restarted because another
    request's check found a bad block c also holds, hits the prefix cache
    again while its own first check is still in flight. Both checks are
    judged, each on its own step's reports, and a block that went bad
    before the re-hit is caught in it: c restarts again and every token it
    returns comes from its clean recompute.

    Bug caught: pending checks keyed by request only. The re-hit's check
    replaced the first; the first step's reports were compared with the
    re-hit's blocks and the re-hit was never judged, so its bad block 1 was
    served with no mismatch. And: a moved-on check's bad block ids trusted
    after vLLM freed them (c restarted for block 2's id, which its re-hit got
    for its own new KV, and its clean blocks evicted)."""
    engine = async_engine(model_dir, "rehit")
    base = prompt(40, PREFIX + 5)
    a = cache_prefix(engine, base)
    b1, b2 = cached_block_id(engine, a, 1), cached_block_id(engine, a, 2)
    assert b1 is not None and b2 is not None
    flip_byte(engine, b2)
    in_flight: list[Step] = []
    add(engine, "d", base[:PREFIX] + [7, 7, 7], max_tokens=3)
    schedule(engine, in_flight)  # d's first step on the hit
    c_tokens = base[:PREFIX] + [8, 8, 8]
    c = add(engine, "c", c_tokens, max_tokens=3)
    schedule(engine, in_flight)  # c's first step on the hit: block 1 still clean
    clean_kv = kv_of(engine, b1)
    flip_byte(engine, b1)  # block 1 goes bad after c's first check read it
    process(engine, in_flight)  # d's verdict: block 2 bad; d and c restart
    assert prefix_verdicts(engine) == {"mismatch": 1}
    # d's client leaves: only c's own checks can catch block 1 now.
    engine.scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    run_all(engine, in_flight, ["c"])
    # d's hit, c's first hit (block 2), c's re-hit of blocks 0-1 (block 1).
    assert prefix_verdicts(engine) == {"mismatch": 3}
    # After meeting bad blocks twice c reads no prefix cache: one step
    # computes its whole prompt, and every token it returns comes after it.
    (clean,) = [
        i
        for i in steps_of(engine, "c")
        if engine.history[i].num_scheduled_tokens["c"] == len(c_tokens)
    ]
    tokens = engine.tokens["c"]
    assert len(tokens) == 3 and all(t >= 1000 + clean for t in tokens), tokens
    # Restarted for block 2, then for block 1; not for block 2's id once vLLM
    # freed it and c's re-hit got it for its own KV.
    assert c.num_preemptions == 2
    again = cached_block_id(engine, a, 1)  # cached again by c's recompute
    assert again is not None and torch.equal(kv_of(engine, again), clean_kv)
    assert not engine.checksums.tracked_request_ids()  # R141


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_computed_over_a_bad_hit_leave_the_cache(
    model_dir: str, policy: str
) -> None:
    """R138, R140: request c runs its first step on a hit holding bad block 2
    (its full blocks 4 and 5 are computed over it and cached when scheduled)
    when another request's check finds block 2 bad. Every block c held from
    position 2 on leaves the prefix cache with the verdict, under both
    policies, as vLLM's own `_handle_invalid_blocks` evicts them under
    "fail"; reference: the block table c ran that step with.

    Bug caught: under "recompute" the restart preempted c but evicted
    nothing, so blocks 4 and 5 stayed cached and a later request hitting
    them (once block 2's hash is cached again) was counted verified."""
    engine = async_engine(model_dir, f"derived-{policy}", policy=policy)
    base = prompt(41, PREFIX + 5)
    a = cache_prefix(engine, base)
    b2 = cached_block_id(engine, a, 2)
    assert b2 is not None
    flip_byte(engine, b2)
    in_flight: list[Step] = []
    add(engine, "d", base[:PREFIX] + [7, 7, 7], max_tokens=3)
    schedule(engine, in_flight)  # d's first step on the hit
    c_tokens = base[:PREFIX] + prompt(42, 2 * BS + 3)
    add(engine, "c", c_tokens, max_tokens=3)
    schedule(engine, in_flight)  # c runs over bad block 2
    held = engine.block_ids("c")[0][2:]
    assert held[0] == b2 and all(is_cached(engine, i) for i in held[2:4])
    process(engine, in_flight)  # d's verdict
    assert prefix_verdicts(engine) == {"mismatch": 1}
    assert [i for i in held if is_cached(engine, i)] == []
    run_all(engine, in_flight, ["c", "d"])
    assert not engine.checksums.tracked_request_ids()  # R141


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_preemption_of_a_checked_request_drops_its_tokens(
    model_dir: str, policy: str
) -> None:
    """R140 under async scheduling: vLLM itself preempts request c (KV cache
    full) while c's first step on a bad hit is in flight, with a connector
    whose preemptions deliver in-flight output (`requires_kv_delivery` off:
    offload connectors, any kv_consumer). c's check then mismatches: the
    token sampled over the bad block never reaches the client, and c's blocks
    computed over it leave the prefix cache. It holds no block any more, so
    under both policies it recomputes (vLLM fails only requests holding the
    bad blocks).

    Bug caught: only RUNNING requests were restarted, so the preempted c was
    skipped and vLLM delivered its stale token from the bad step (and its
    full block computed over the bad one stayed cached: vLLM had freed c's
    blocks, so evicting "the request's blocks" found none)."""
    # 8 usable blocks: c's 4 hit and 2 new ones, r's 2; r's next block
    # makes vLLM preempt c, the last running request.
    engine = async_engine(
        model_dir,
        f"preempted-{policy}",
        policy=policy,
        num_blocks=9,
        kv_role="kv_consumer",
    )
    assert not engine.scheduler.requires_kv_delivery
    base = prompt(46, PREFIX + 5)
    a = cache_prefix(engine, base)
    b2 = cached_block_id(engine, a, 2)
    assert b2 is not None
    flip_byte(engine, b2)
    in_flight: list[Step] = []
    add(engine, "r", prompt(47, 2 * BS - 1), max_tokens=6)
    schedule(engine, in_flight)  # r's prompt
    c_tokens = base[:PREFIX] + prompt(48, BS + 3)
    add(engine, "c", c_tokens, max_tokens=3)
    bad_step = len(engine.history)
    schedule(engine, in_flight)  # c's first step, on the bad hit
    held = engine.block_ids("c")[0][2:]
    assert held[0] == b2 and is_cached(engine, held[2])  # block 4: over block 2
    process(engine, in_flight)
    schedule(engine, in_flight)  # r needs a block: vLLM preempts c
    c = engine.scheduler.requests["c"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_stale_output_tokens == len(c_tokens) - PREFIX  # the bad step's
    process(engine, in_flight)  # c's verdict
    assert prefix_verdicts(engine) == {"mismatch": 1}
    assert [i for i in held if is_cached(engine, i)] == []
    run_all(engine, in_flight, ["c", "r"])
    # c's recompute: its first later step computing more than one token.
    recompute = next(
        i
        for i in steps_of(engine, "c")
        if i > bad_step and engine.history[i].num_scheduled_tokens["c"] > 1
    )
    tokens = engine.tokens["c"]
    assert len(tokens) == 3 and all(t >= 1000 + recompute for t in tokens), tokens
    assert not engine.checksums.tracked_request_ids()  # R141


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_request_waiting_for_remote_kv_never_runs_on_a_known_bad_block(
    model_dir: str, policy: str
) -> None:
    """R140, R95: consumer request w waits for its remote KV (an async P/D
    load) holding a local hit that includes block 2, when request d's check
    finds block 2 bad. w never runs with block 2 in its block table: under
    "recompute" its load counts as failed and it recomputes from its clean
    prefix (vLLM's failed-load path), under "fail" it ends with an error.

    Bug caught: under "recompute" only running requests were restarted, so w
    kept the known-bad block and computed over it once its load finished."""
    engine = async_engine(model_dir, f"remote-{policy}", policy=policy)
    base = prompt(43, PREFIX + 5)
    a = cache_prefix(engine, base)
    b2 = cached_block_id(engine, a, 2)
    assert b2 is not None
    flip_byte(engine, b2)
    in_flight: list[Step] = []
    w_tokens = base[:PREFIX] + prompt(44, 2 * BS + 3)
    add(
        engine,
        "w",
        w_tokens,
        max_tokens=2,
        kv_transfer_params=consumer_kv_transfer_params("remote-w"),
    )
    add(engine, "d", base[:PREFIX] + [7, 7, 7], max_tokens=2)
    schedule(engine, in_flight)  # w starts its load; d runs on the hit
    w = engine.scheduler.requests["w"]
    assert w.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.block_ids("w")[0][2] == b2
    schedule(engine, in_flight)
    process(engine, in_flight)  # d's verdict: block 2 bad
    assert prefix_verdicts(engine) == {"mismatch": 1}
    engine.finish_load("w")
    ran_on_bad: list[int] = []

    def check(output: Any) -> None:
        if "w" in output.num_scheduled_tokens and b2 in engine.block_ids("w")[0]:
            ran_on_bad.append(len(engine.history) - 1)

    run_all(engine, in_flight, ["w", "d"], after_schedule=check)
    assert ran_on_bad == []
    if policy == "fail":
        assert engine.final["w"].finish_reason == FinishReason.ERROR
    else:
        assert engine.final["w"].finish_reason == FinishReason.LENGTH
        # Its clean re-hit (blocks 0-1) was checked in the step it ran.
        assert prefix_verdicts(engine).get("verified", 0) >= 1


@pytest.mark.parametrize("how", ["worker", "guard"])
def test_no_state_kept_once_checksums_stop(model_dir: str, how: str) -> None:
    """R141, R134: after a worker reports its checksums disabled, and on an
    engine whose scheduler guard tripped, prefix-hit verification stops and
    keeps nothing: no entry, no save waiting for a step, no noted hit.

    Bug caught: the block-pool hook kept appending every cached block to the
    step's save list, which nothing drained any more (memory growing for the
    engine's lifetime, not shown by the tracked-requests gauge)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumRecord,
    )

    engine = async_engine(model_dir, f"stopped-{how}")
    state = prefix_hit_verifier(engine.scheduler)
    hits = state.hits
    cache_prefix(engine, prompt(45, PREFIX + 5))
    assert hits.num_entries == PREFIX // BS
    if how == "worker":
        marker = KVChecksumRecord(pp_rank=0, tp_rank=0, disabled=True)
        engine.workers[0].checksum.post_forward = lambda *a, **k: marker
    else:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected into add_sends")

        engine.checksums.add_sends = broken
    for i in range(4):
        req = add(engine, f"r{i}", prompt(50 + i, 3 * BS + 2), max_tokens=2)
        engine.run_pipelined(req.request_id)
    assert prefix_hit_verifier(engine.scheduler) is None and state.released
    assert not hits._step.saves and not hits._step.keys and not state.noted
    assert hits.num_entries == 0 and not hits.has_entry.any()
    assert not hits.pending
