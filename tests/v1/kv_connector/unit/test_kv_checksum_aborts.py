# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Aborts at every point of a checked load, on vLLM 0.33.0's real Scheduler
(R141): every per-request structure of the package is released, nothing
raises, and an aborted load gets no verdict at all (it is counted nowhere:
neither verified, nor mismatch, nor unverified).

The abort is vLLM's own `finish_requests(..., FINISHED_ABORTED)`, the call
the engine core makes when a client disconnects. "Between the load and its
verification" is an abort that lands after the worker reported the load
finished and before the scheduler's `update_from_output` (the engine core
handles aborts there under async scheduling and the batch queue).
"""

import random
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    OFFLOAD_CONNECTOR_NAME,
    OFFLOAD_TOKENS_KEY,
    Fault,
    SideConfig,
    SimEngine,
    apply_fault,
    capture_verdicts,
    package_state,
    per_group,
    produce,
    transfer,
)
from vllm.distributed.kv_transfer.kv_checksum.config import VERIFY_PREFIX_HITS_KEY
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import KVChecksumStatus
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16


def prompt(i: int, length: int = 40) -> list[int]:
    """Distinct per i: no prefix hits between them."""
    return [(97 * i + 13 * k) % 991 + 3 for k in range(length)]


def abort(engine: SimEngine, req_id: str) -> None:
    engine.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


def abort_before_verification(engine: SimEngine, req_id: str) -> None:
    """Abort `req_id` in the next step after the workers reported, before the
    scheduler's update_from_output (the checksum verification) runs."""
    scheduler = engine.scheduler
    original = scheduler.update_from_output

    def update_from_output(output: Any, model_output: Any) -> Any:
        del scheduler.update_from_output
        abort(engine, req_id)
        return original(output, model_output)

    scheduler.update_from_output = update_from_output


def worker_state(engine: SimEngine) -> int:
    """Entries the checksum workers keep across steps (loads in flight)."""
    return sum(
        len(w.checksum._to_recv) + len(w.checksum._to_load) for w in engine.workers
    )


def assert_released(engine: SimEngine) -> None:
    """R141: after one more step (the workers hear of the finished requests),
    no request holds checksum state on the scheduler or the workers."""
    engine.step()
    assert engine.checksums.tracked_request_ids() == set()
    assert package_state(engine, engine.scheduler.connector) == 0
    assert worker_state(engine) == 0
    containment = engine.scheduler.__dict__.get("kv_checksum_containment")
    assert containment is None or not containment


def pd_pair(model_dir: str, **consumer: Any) -> tuple[SimEngine, SimEngine]:
    producer = SimEngine(model_dir, SideConfig(), "producer")
    side = SideConfig(fail_closed=True, policy="recompute", **consumer)
    return producer, SimEngine(model_dir, side, "consumer")


def start_load(
    consumer: SimEngine, producer: SimEngine, req_id: str, i: int
) -> dict[str, Any]:
    """A consumer request whose load started (WAITING_FOR_REMOTE_KVS), with
    its KV transferred; returns the producer's params."""
    params = produce(producer, f"p-{req_id}", prompt(i))
    consumer.add(
        make_request(req_id, prompt(i), max_tokens=3, kv_transfer_params=params)
    )
    consumer.step()
    request = consumer.scheduler.requests[req_id]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    load = consumer.loads[req_id]
    end = request.num_computed_tokens
    positions = list(range(end - load.num_external_tokens, end))
    transfer(
        producer,
        per_group(params["remote_block_ids"]),
        consumer,
        per_group(load.block_ids),
        positions,
    )
    return params


# --------------------------------------------------------------------------
# Consumer: P/D loads (the kv_transfer_params carrier, as NIXL pull)
# --------------------------------------------------------------------------


def test_abort_before_the_load_starts(model_dir: str) -> None:
    """R141 (a): a consumer request aborted before it was scheduled drops its
    note (bug: `_noted` kept for a request that never reaches `add_recv`)."""
    producer, consumer = pd_pair(model_dir)
    params = produce(producer, "p-a", prompt(1))
    consumer.add(make_request("a", prompt(1), kv_transfer_params=params))
    assert consumer.checksums.tracked_request_ids() == {"a"}
    abort(consumer, "a")
    assert_released(consumer)
    assert not consumer.checksums.stats.loads


def test_abort_while_the_load_is_in_flight(model_dir: str) -> None:
    """R141 (b): aborted after the load started, before it finished; the load
    then reports finished. No verdict, nothing kept (bug: the pending receive
    or the workers' `_to_recv` entry outliving the request, or a late
    finished load verified against nothing and counted unverified)."""
    producer, consumer = pd_pair(model_dir)
    start_load(consumer, producer, "b", 2)
    assert consumer.checksums.tracked_request_ids() == {"b"}
    abort(consumer, "b")
    consumer.step()  # finished_req_ids reach the workers while loading
    consumer.finish_load("b")
    consumer.step()
    assert_released(consumer)
    assert not consumer.checksums.stats.loads


@pytest.mark.parametrize("fault", [None, Fault("bit_flip")])
def test_abort_between_load_and_verification(model_dir: str, fault: Any) -> None:
    """R141 (c): aborted in the step the load finishes, after the workers
    checksummed it and before the scheduler verifies: no verdict (an aborted
    load is never a mismatch, even over bad KV), no quarantine left, nothing
    kept (bug: a verdict and quarantine for a request vLLM already freed)."""
    producer, consumer = pd_pair(model_dir)
    start_load(consumer, producer, "c", 3)
    if fault is not None:
        engine_blocks = per_group(consumer.loads["c"].block_ids)[0]
        worker = consumer.workers[0]
        cache = next(iter(worker.caches.values())).view(torch.uint8)
        cache[engine_blocks[0]].view(-1)[0] ^= 0x10
    consumer.finish_load("c")
    abort_before_verification(consumer, "c")
    consumer.step()
    assert_released(consumer)
    assert not consumer.checksums.stats.loads
    assert not consumer.checksums.stats.quarantined_blocks


@pytest.mark.parametrize("fault", [None, Fault("bit_flip")])
def test_abort_during_decode(model_dir: str, fault: Any) -> None:
    """R141 (d): aborted while decoding after a verified (or, fail-closed,
    mismatched and recomputed) load: the one verdict stays, nothing is kept
    (bug: a quarantine released only on a normal finish)."""
    producer, consumer = pd_pair(model_dir)
    params = produce(producer, "p-d", prompt(4))
    consumer.add(make_request("d", prompt(4), max_tokens=50, kv_transfer_params=params))
    consumer.step()
    request = consumer.scheduler.requests["d"]
    load = consumer.loads["d"]
    end = request.num_computed_tokens
    positions = list(range(end - load.num_external_tokens, end))
    blocks = per_group(load.block_ids)
    transfer(
        producer, per_group(params["remote_block_ids"]), consumer, blocks, positions
    )
    if fault is not None:
        cache = next(iter(consumer.workers[0].caches.values())).view(torch.uint8)
        cache[blocks[0][0]].view(-1)[0] ^= 0x10
    consumer.finish_load("d")
    for _ in range(4):
        consumer.step()
    assert request.status == RequestStatus.RUNNING
    abort(consumer, "d")
    assert_released(consumer)
    expected = "verified" if fault is None else "mismatch"
    assert dict(consumer.checksums.stats.loads) == {expected: 1}


# --------------------------------------------------------------------------
# Producer
# --------------------------------------------------------------------------


def test_producer_abort_before_its_prompt_finishes(model_dir: str) -> None:
    """R141 (e): a producer request aborted mid-prompt (chunked) drops its
    producer entry; no payload (bug: `_producers` kept for an aborted
    request)."""
    producer = SimEngine(model_dir, SideConfig(max_num_batched_tokens=16), "p")
    producer.add(
        make_request(
            "e", prompt(5), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
    )
    producer.step()
    assert producer.checksums.tracked_request_ids() == {"e"}
    abort(producer, "e")
    assert_released(producer)
    assert not producer.checksums.stats.sent


def test_producer_abort_in_the_step_its_prompt_finishes(model_dir: str) -> None:
    """R141 (e): aborted after the step that finishes the prompt was
    scheduled (its send registered) and before its output is processed: no
    payload, the pending send released (bug: `_sends` kept, or a payload
    built for KV no consumer will read)."""
    producer = SimEngine(model_dir, SideConfig(), "p")
    producer.add(
        make_request(
            "e2", prompt(6), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
    )
    abort_before_verification(producer, "e2")
    producer.step()
    assert_released(producer)
    assert not producer.checksums.stats.sent


def test_producer_whose_consumer_never_pulls(model_dir: str) -> None:
    """R141 (f): a finished producer request whose consumer dies (never
    pulls) holds its blocks until vLLM frees them on lease expiry; the
    package holds nothing for it meanwhile, nor after (bug: per-request state
    kept until a transfer that never comes)."""
    side = SideConfig(connector_extra={"test_delay_free": True})
    producer = SimEngine(model_dir, side, "p")
    params = produce(producer, "f", prompt(7))
    assert params["remote_block_ids"]
    assert producer.scheduler.kv_cache_manager.get_block_ids("f")[0]  # held
    assert producer.checksums.tracked_request_ids() == set()
    assert_released(producer)
    assert producer.checksums.stats.sent == 1


# --------------------------------------------------------------------------
# Offload loads and prefix-hit checks
# --------------------------------------------------------------------------


def offload_engine(model_dir: str) -> SimEngine:
    side = SideConfig(
        connector=OFFLOAD_CONNECTOR_NAME, fail_closed=True, policy="recompute"
    )
    engine = SimEngine(model_dir, side, "offload")
    for worker in engine.workers:
        worker.checksum.init_block_checksums([0])
    return engine


@pytest.mark.parametrize("point", ["in_flight", "before_verification"])
def test_offload_load_aborted(model_dir: str, point: str) -> None:
    """R141: a checked offload load aborted in flight or between the load and
    its verification: no verdict, no failure reported to the connector,
    nothing kept (bug: `offload.pending` or the workers' `_to_load` entry
    outliving the request)."""
    engine = offload_engine(model_dir)
    params = {OFFLOAD_TOKENS_KEY: 3 * BS}
    engine.add(
        make_request("o", prompt(8, 60), max_tokens=2, kv_transfer_params=params)
    )
    engine.step()
    assert engine.checksums.tracked_request_ids() == {"o"}
    engine.finish_load("o")
    if point == "in_flight":
        abort(engine, "o")
    else:
        abort_before_verification(engine, "o")
    engine.step()
    assert_released(engine)
    assert not engine.checksums.stats.loads
    assert engine.scheduler.connector.failures == []


def prefix_engine(model_dir: str) -> SimEngine:
    side = SideConfig(
        num_blocks=48,
        fail_closed=True,
        policy="recompute",
        connector_extra={VERIFY_PREFIX_HITS_KEY: True},
    )
    engine = SimEngine(model_dir, side, "prefix")
    for worker in engine.workers:
        worker.checksum.enable_prefix_entries()
    return engine


@pytest.mark.parametrize("corrupt", [False, True])
def test_prefix_hit_check_aborted(model_dir: str, corrupt: bool) -> None:
    """R141, R140: a request aborted between its prefix-hit check's step and
    that check's verification leaves no pending check and no quarantine
    (bug: the verdict of the freed request's mismatching hit quarantines it
    after vLLM freed its blocks, and nothing ever releases it)."""
    engine = prefix_engine(model_dir)
    base = prompt(9, 4 * BS + 5)
    first = make_request("a", base, max_tokens=1, block_size=BS)
    engine.add(first)
    engine.run("a")
    if corrupt:
        pool = engine.scheduler.kv_cache_manager.block_pool
        block = pool.get_cached_block(first.block_hashes[1], [0])[0]
        for worker in engine.workers:
            cache = next(iter(worker.caches.values())).view(torch.uint8)
            cache[block.block_id].view(-1)[0] ^= 0x5A
    engine.add(make_request("h", base[: 4 * BS] + [7, 7, 7], max_tokens=4))
    abort_before_verification(engine, "h")
    engine.step()
    assert_released(engine)


# --------------------------------------------------------------------------
# Soak: interleaved requests, aborts and faults
# --------------------------------------------------------------------------

SOAK_REQUESTS = 300
SOAK_CONCURRENCY = 16


def test_soak_aborts_and_faults(model_dir: str) -> None:
    """R141, R131: 300 P/D requests at concurrency 16, fail-closed with
    "recompute", 5 % aborted at a random step (before, during or right after
    the load, or in decode) and 4 % with a bit flipped in the loaded KV;
    deterministic (seeded), no timing. No false mismatch, every fault that
    reached verification is a mismatch, no aborted load gets a verdict, every
    request ends (length or abort) and nothing is kept at the end (bugs: a
    leak on any abort path, a verdict for an aborted load, a wrong verdict
    under interleaving)."""
    rng = random.Random(141)
    producer = SimEngine(model_dir, SideConfig(), "producer")
    consumer = SimEngine(
        model_dir,
        SideConfig(fail_closed=True, policy="recompute", num_blocks=160),
        "consumer",
    )
    verdicts = capture_verdicts(consumer)
    pending = list(range(SOAK_REQUESTS))
    live: dict[str, dict[str, Any]] = {}
    faulted: set[str] = set()
    aborted: set[str] = set()
    step = 0
    while pending or live:
        while pending and len(live) < SOAK_CONCURRENCY:
            i = pending.pop(0)
            req_id = f"r{i}"
            tokens = [rng.randrange(3, 990) for _ in range(40)]  # no shared prefix
            params = produce(producer, f"p{i}", tokens)
            consumer.add(
                make_request(
                    req_id,
                    tokens,
                    max_tokens=rng.randrange(2, 8),
                    kv_transfer_params=params,
                )
            )
            live[req_id] = {
                "params": params,
                "fault": rng.random() < 0.04,
                "abort_at": step + rng.randrange(0, 8) if rng.random() < 0.05 else None,
                "finish_at": None,
                "reported": False,
            }
        late_abort = False
        for req_id, info in live.items():
            if info["abort_at"] == step:
                aborted.add(req_id)
                if late_abort or rng.random() < 0.5:
                    abort(consumer, req_id)
                else:  # at most one per step: it wraps this step's update
                    abort_before_verification(consumer, req_id)
                    late_abort = True
            finish_at = info["finish_at"]
            if finish_at is not None and finish_at <= step and not info["reported"]:
                consumer.finish_load(req_id)  # done or timed out, aborted or not
                info["reported"] = True
        consumer.step()
        step += 1
        for req_id, info in list(live.items()):
            request = consumer.scheduler.requests.get(req_id)
            if request is None:
                del live[req_id]
                continue
            if info["finish_at"] is not None or req_id not in consumer.loads:
                continue
            if request.is_finished():  # aborted while loading
                info["finish_at"] = step + rng.randrange(0, 3)
                continue
            load = consumer.loads[req_id]
            end = request.num_computed_tokens
            positions = list(range(end - load.num_external_tokens, end))
            blocks = per_group(load.block_ids)
            copied = transfer(
                producer,
                per_group(info["params"]["remote_block_ids"]),
                consumer,
                blocks,
                positions,
            )
            if info["fault"]:
                faulted.add(req_id)
                # Full blocks only: the last loaded block (7 of 16 tokens)
                # is partial, and a flip there is not compared (see report).
                fault = Fault("bit_flip", position=rng.randrange(0, 2))
                apply_fault(consumer, blocks[0], copied[0], fault)
            info["finish_at"] = step + rng.randrange(0, 3)
        assert step < 40 * SOAK_REQUESTS
    assert_released(consumer)
    assert_released(producer)
    assert len(aborted) >= 5 and len(faulted) >= 3, (len(aborted), len(faulted))
    false = {
        r: v.status
        for r, v in verdicts.items()
        if r not in faulted and v.status != KVChecksumStatus.VERIFIED
    }
    assert false == {}
    wrong = {
        r: verdicts[r]
        for r in faulted - aborted
        if verdicts[r].status != KVChecksumStatus.MISMATCH
    }
    assert wrong == {}
    assert not (faulted - aborted) - set(verdicts)
    for i in range(SOAK_REQUESTS):
        req_id = f"r{i}"
        if req_id in aborted:  # the engine core, not the scheduler, answers
            assert req_id not in consumer.final or str(
                consumer.final[req_id].finish_reason
            ) in ("abort", "length")
        else:
            assert str(consumer.final[req_id].finish_reason) == "length", req_id
    loads = consumer.checksums.stats.loads
    assert sum(loads.values()) == len(verdicts)
