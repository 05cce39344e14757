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

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig, SimEngine
from vllm.distributed.kv_transfer.kv_checksum.config import VERIFY_PREFIX_HITS_KEY

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
PREFIX = 4 * BS
STATE_ATTR = "_kv_checksum_prefix_hits"
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
    state = engine.scheduler.__dict__[STATE_ATTR]
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
    assert engine.scheduler.__dict__[STATE_ATTR] is None
    assert not hits._step.saves and not hits._step.keys and not state.noted
    assert hits.num_entries == 0 and not hits.has_entry.any()
    assert not hits.pending
