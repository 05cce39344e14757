# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end P/D tests of KV checksums on real vLLM schedulers (R123).

Every test runs real producer and consumer `Scheduler`s (or `AsyncScheduler`s)
with the plugin's hooks and one real `KVChecksumWorker` per simulated
(pp_rank, tp_rank) over CPU KV caches (`kv_checksum_pd.SimEngine`). The
producer's blocks are copied into the consumer's by token position, optionally
corrupted, and the load is reported finished; the consumer's verdict shows in
its `KVChecksumScheduler.stats`, its logs and the request's finish reason.

The carrier is the test connector declaring the kv_transfer_params carrier
(`KVChecksumCarrierTestConnector`); NIXL pull is checked at the carrier API.
NIXL push and Mooncake are covered in test_kv_checksum_nixl_push.py and
test_kv_checksum_mooncake.py. Not covered here: Mamba (R123's other cases), and a
producer preempted inside its last prefill step before that step's output
arrives (R75's mixed reports; covered at the verification level by R84).

Each test builds its own engines (about 0.2 s each once vLLM is imported):
checksum schedulers warn once per reason and keep counts, so fresh engines keep
the log and stats assertions exact.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import re
from typing import Any

import msgspec
import numpy as np
import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    TEST_CONNECTOR_NAME,
    make_request,
    register_plugin,
    skip_unless_capability,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    FAULT_KINDS,
    WHOLE_PROMPT_CONNECTOR_NAME,
    Fault,
    LoadResult,
    SideConfig,
    SimEngine,
    consume,
    per_group,
    produce,
    run_local,
)
from vllm.distributed.kv_transfer.kv_checksum import config as checksum_config
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    DEFAULT_MAX_ENCODED_BYTES,
    KVChecksumPayload,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

PROMPT_LEN = 60

MISMATCH = "KV checksum mismatch for request"
NOT_SENT_WORKERS = "KV checksums not sent: not every worker reported its checksums."
NO_CHECKSUMS = "KV checksums not verified: the producer sent no checksums."
INVALID = "KV checksums not verified: the producer's checksums are invalid."
NOT_ALL_WORKERS = "KV checksums not verified: not every worker reported its checksums."
ONE_SIDE = "KV checksums not verified: a group is checksummed by one side only."

SCHEDULERS = pytest.mark.parametrize(
    "async_scheduler", [False, True], ids=["sync", "async"]
)

# consumer mode -> (kv_checksum_fail_closed, kv_load_failure_policy)
MODES = {
    "fail-open": (False, "fail"),
    "fail-closed-fail": (True, "fail"),
    "fail-closed-recompute": (True, "recompute"),
}


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def make_prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    """Distinct token ids (3..999, never eos) for a seed."""
    return [(seed * 389 + 37 * i + (i * i) % 11) % 997 + 3 for i in range(length)]


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def mismatch_positions(caplog: pytest.LogCaptureFixture, req_id: str) -> dict:
    """group -> block positions of the mismatch error logged for `req_id`."""
    found: dict[int, list[int]] = {}
    for message in messages(caplog, logging.ERROR):
        if message.startswith(f"{MISMATCH} {req_id}:"):
            for group, positions in re.findall(
                r"group (\d+) block positions \[([\d, ]*)\]", message
            ):
                found[int(group)] = [int(p) for p in positions.split(",") if p]
    return found


def verdicts(engine: SimEngine) -> dict[str, int]:
    return dict(engine.checksums.stats.loads)


def engines(
    model_dir: str, producer: SideConfig, consumer: SideConfig
) -> tuple[SimEngine, SimEngine]:
    return SimEngine(model_dir, producer, "P"), SimEngine(model_dir, consumer, "D")


def mode_config(mode: str, **kwargs: Any) -> SideConfig:
    fail_closed, policy = MODES[mode]
    return SideConfig(fail_closed=fail_closed, policy=policy, **kwargs)


def assert_outcome(result: LoadResult, consumer: SimEngine, mode: str) -> None:
    """The failure semantics of R94/R95 for a load that did not verify."""
    if mode == "fail-open":
        # R94: the loaded KV is used; only the last prompt token is computed.
        assert result.finish_reason == "length"
        assert result.computed_after_load == result.num_loaded_tokens
        assert consumer.scheduled_tokens(result.request_id) == 2
    elif mode == "fail-closed-fail":
        # R95 "fail": the request ends with an error, nothing computed on it.
        assert result.finish_reason == "error"
        assert consumer.scheduled_tokens(result.request_id) == 0
    else:
        # R95 "recompute": num_computed_tokens reset, whole prompt local.
        assert result.computed_after_load == 0
        assert result.finish_reason == "length"
        assert consumer.scheduled_tokens(result.request_id) == PROMPT_LEN + 1


# --------------------------------------------------------------------------
# Producer side: what is sent (R68, R74, R80)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp,pp,layout",
    [
        (2, 1, KVCacheLayout.LBHNC),
        (1, 2, KVCacheLayout.LBHNC),
        (2, 2, KVCacheLayout.BLHNC),
    ],
    ids=["TP2", "PP2", "TP2xPP2-BLHNC"],
)
def test_producer_payload_independent_of_tp_pp(
    model_dir: str, tp: int, pp: int, layout: KVCacheLayout
) -> None:
    """R3, R80, R87: a TP2 / PP2 / TP2xPP2 producer (another layout too) sends
    exactly the values and fingerprints one TP1 worker sends, for a full and a
    sliding-window group. Catches summing fingerprints of every worker or of one
    PP stage, dropping a worker's or a replica's part, and layout-dependent
    values."""
    prompt = make_prompt(1)
    reference = SimEngine(model_dir, SideConfig(groups="both"), "P1")
    sharded = SimEngine(
        model_dir, SideConfig(tp=tp, pp=pp, layout=layout, groups="both"), "Pn"
    )
    ours = produce(reference, "r", prompt)
    theirs = produce(sharded, "r", prompt)
    one = KVChecksumPayload.from_base64(ours[KV_TRANSFER_PARAMS_KEY])
    many = KVChecksumPayload.from_base64(theirs[KV_TRANSFER_PARAMS_KEY])

    assert (one.tp_size, many.tp_size) == (1, tp)
    assert one.version == many.version == 2
    assert one.num_tokens == many.num_tokens == PROMPT_LEN
    # Group 0: full attention, every prompt block; group 1: sliding window of
    # 32 tokens, the last ceil(32 / 16) + 1 = 3 blocks (R66).
    header = [(g.group_id, g.fingerprint, g.chunk_tokens, g.start) for g in one.groups]
    assert header == [
        (g.group_id, g.fingerprint, g.chunk_tokens, g.start) for g in many.groups
    ]
    assert [(g, s) for g, _, _, s in header] == [(0, 0), (1, 1)]
    for a, b in zip(one.groups, many.groups):
        assert len(a.values) == (4 if a.group_id == 0 else 3)
        np.testing.assert_array_equal(a.values, b.values)
        assert len(set(a.values.tolist())) == len(a.values)  # not degenerate
    assert reference.checksums.stats.sent == sharded.checksums.stats.sent == 1


def assert_whole_prompt_payload(
    params: dict[str, Any], expected: KVChecksumPayload
) -> None:
    """The params carry the whole prompt's payload, equal to `expected`'s."""
    payload = KVChecksumPayload.from_base64(params[KV_TRANSFER_PARAMS_KEY])
    assert payload.num_tokens == expected.num_tokens == PROMPT_LEN
    assert [(g.group_id, g.start) for g in payload.groups] == [(0, 0)]
    np.testing.assert_array_equal(payload.groups[0].values, expected.groups[0].values)


def test_chunked_prefill_checksums_whole_prompt_once(model_dir: str) -> None:
    """R68: with chunked prefill (24-token steps) the producer checksums the
    whole prompt once, in the step that finishes it, and sends what an
    unchunked producer sends; the load verifies fail-closed. Catches
    registering per chunk (only the last chunk's blocks, or an earlier chunk's
    partial blocks, sent)."""
    prompt = make_prompt(20)
    whole = SimEngine(model_dir, SideConfig(), "P1")
    chunked = SimEngine(model_dir, SideConfig(max_num_batched_tokens=24), "Pc")
    consumer = SimEngine(model_dir, SideConfig(fail_closed=True), "D")
    expected = KVChecksumPayload.from_base64(
        produce(whole, "r", prompt)[KV_TRANSFER_PARAMS_KEY]
    )
    params = produce(chunked, "r", prompt)
    chunks = [o.num_scheduled_tokens.get("r", 0) for o in chunked.history]
    assert chunks[:3] == [24, 24, 12]
    sends = [o for o in chunked.history if o.kv_checksum_scheduled is not None]
    assert len(sends) == 1 and sends[0] is chunked.history[2]
    assert_whole_prompt_payload(params, expected)
    result = consume(consumer, chunked, "r", prompt, params)
    assert verdicts(consumer) == {"verified": 1}
    assert result.finish_reason == "length"


def test_uncarried_requests_get_no_checksums(model_dir: str) -> None:
    """R68, R74: only `do_remote_decode` requests are checksummed and sent: a
    local request and one with `do_remote_decode` false schedule no send and
    get no "kv_checksums". Catches checksumming (and sending) every request."""
    producer = SimEngine(model_dir, SideConfig(), "P")
    local = run_local(producer, "local", make_prompt(1))
    assert local.kv_transfer_params is None
    producer.add(
        make_request(
            "no-decode",
            make_prompt(2),
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": False},
        )
    )
    params = producer.run("no-decode").kv_transfer_params
    assert not params or KV_TRANSFER_PARAMS_KEY not in params
    assert producer.sent_blocks("local") is None
    assert producer.sent_blocks("no-decode") is None
    assert producer.checksums.stats.sent == 0
    # The same engine does send for a producer request.
    assert KV_TRANSFER_PARAMS_KEY in produce(producer, "sent", make_prompt(3))
    assert producer.sent_blocks("sent") is not None
    assert producer.checksums.stats.sent == 1


@pytest.mark.parametrize("silent_side", ["producer", "consumer"])
def test_nothing_sent_or_verified_unless_all_workers_reported(
    model_dir: str, vllm_caplog, silent_side: str
) -> None:
    """R80, R82: a producer with one TP rank's record lost sends nothing (warning
    "KV checksums not sent: ..."), and the consumer's load is then unverified
    ("no checksums"); a consumer with one rank's record lost leaves the load
    unverified ("not every worker reported"), failing it fail-closed. Catches
    sending or verifying partial sums (the missing rank's heads unchecked)."""
    silent = ((0, 1),)
    producer_side = SideConfig(
        tp=2, silent_workers=silent if silent_side == "producer" else ()
    )
    consumer_side = SideConfig(
        tp=2,
        fail_closed=True,
        silent_workers=silent if silent_side == "consumer" else (),
    )
    producer, consumer = engines(model_dir, producer_side, consumer_side)
    prompt = make_prompt(4)
    params = produce(producer, "r", prompt)
    warnings = messages(vllm_caplog, logging.WARNING)
    if silent_side == "producer":
        assert KV_TRANSFER_PARAMS_KEY not in params
        assert NOT_SENT_WORKERS in warnings
        assert producer.checksums.stats.sent == 0
        expected = NO_CHECKSUMS
    else:
        assert KV_TRANSFER_PARAMS_KEY in params
        assert NOT_SENT_WORKERS not in warnings
        expected = NOT_ALL_WORKERS
    result = consume(consumer, producer, "r", prompt, params)
    assert verdicts(consumer) == {"unverified": 1}
    assert expected in messages(vllm_caplog, logging.WARNING)
    assert result.finish_reason == "error"


# --------------------------------------------------------------------------
# Correct loads verify (R64, R70, R72, R82-R93)
# --------------------------------------------------------------------------

PAIRS = [
    pytest.param(SideConfig(), SideConfig(), id="1x1-1x1"),
    pytest.param(SideConfig(tp=2), SideConfig(), id="2x1-1x1"),
    pytest.param(SideConfig(), SideConfig(tp=2), id="1x1-2x1"),
    pytest.param(SideConfig(pp=2), SideConfig(), id="1x2-1x1"),
    pytest.param(SideConfig(), SideConfig(tp=2, pp=2), id="1x1-2x2"),
    pytest.param(
        SideConfig(layout=KVCacheLayout.BLHNC), SideConfig(tp=2), id="BLHNC-2x1"
    ),
    pytest.param(
        SideConfig(tp=2),
        SideConfig(layout=KVCacheLayout.LBHNC, kernel_block_size=8),
        id="2x1-kernel8",
    ),
    pytest.param(
        SideConfig(pp=2, layout=KVCacheLayout.LBHNC, kernel_block_size=8),
        SideConfig(tp=2, pp=2, layout=KVCacheLayout.BLHNC),
        id="1x2-kernel8-2x2-BLHNC",
    ),
]


@SCHEDULERS
@pytest.mark.parametrize("producer_side,consumer_side", PAIRS)
def test_correct_load_verifies(
    model_dir: str,
    vllm_caplog,
    producer_side: SideConfig,
    consumer_side: SideConfig,
    async_scheduler: bool,
) -> None:
    """R3, R82-R93: an intact load verifies for the (TP, PP) pairs of R123 and
    for non-default layouts and kernel-block splits on one side, fail-closed
    (so anything but "verified" would fail the request). Catches ignoring the
    received checksums (unverified "no checksums"), TP/PP/layout-dependent
    values, and checksumming other blocks than the load wrote."""
    producer_side = dataclasses.replace(producer_side, async_scheduler=async_scheduler)
    consumer_side = dataclasses.replace(
        consumer_side, fail_closed=True, policy="fail", async_scheduler=async_scheduler
    )
    producer, consumer = engines(model_dir, producer_side, consumer_side)
    prompt = make_prompt(5)
    params = produce(producer, "r", prompt)
    result = consume(consumer, producer, "r", prompt, params)
    assert verdicts(consumer) == {"verified": 1}
    assert result.finish_reason == "length"
    assert result.computed_after_load == PROMPT_LEN - 1
    assert result.recv_blocks is not None
    assert result.recv_blocks.groups[0][0] == 0
    assert not messages(vllm_caplog, logging.ERROR)
    assert not [m for m in messages(vllm_caplog, logging.WARNING) if "KV checksum" in m]


@SCHEDULERS
def test_prefix_hit_compares_only_loaded_blocks(
    model_dir: str, vllm_caplog, async_scheduler: bool
) -> None:
    """R64, R70, R88: after a local prefix-cache hit of 32 tokens the consumer
    checksums only the blocks the load wrote (positions from 2), and the load
    verifies although its locally computed prefix differs from the producer's
    KV (`kv_salt`, as decode-computed KV is not bit-identical). Catches
    checksumming loads from block 0 (false mismatch on the local blocks)."""
    producer, consumer = engines(
        model_dir,
        SideConfig(async_scheduler=async_scheduler),
        SideConfig(fail_closed=True, kv_salt=1, async_scheduler=async_scheduler),
    )
    shared = make_prompt(6)[:32]
    run_local(consumer, "local", shared + make_prompt(7)[:20])
    prompt = shared + make_prompt(8)[: PROMPT_LEN - 32]
    params = produce(producer, "r", prompt)
    result = consume(consumer, producer, "r", prompt, params)

    assert result.num_local_tokens == 32
    assert result.num_loaded_tokens == PROMPT_LEN - 1 - 32
    assert result.recv_blocks is not None
    start, block_ids = result.recv_blocks.groups[0]
    assert start == 2
    assert len(block_ids) == 2  # tokens [32, 59)
    assert verdicts(consumer) == {"verified": 1}
    assert result.finish_reason == "length"
    # The local prefix really differs from the producer's KV.
    ours = consumer.read_global(per_group(consumer.loads["r"].block_ids)[0], range(32))
    theirs = producer.read_global(per_group(params["remote_block_ids"])[0], range(32))
    assert any((ours[k] != theirs[k]).any() for k in ours)


def test_load_starting_inside_a_producer_block_verifies(model_dir: str) -> None:
    """R135 (issue 13): a 16-token-block consumer after a 16-token local hit
    loads tokens from 16, inside the producer's first 32-token block. The
    producer sends 16-token chunks, so the load verifies, and a flipped bit in
    the first loaded block is a mismatch at exactly that position. Under v1
    this load was unverified ("the first loaded block starts inside a producer
    block"), failing healthy requests fail-closed; catches a producer sending
    per block again, or the consumer skipping the first loaded block."""
    for fault in (None, Fault("bit_flip", 0)):
        producer, consumer = engines(
            model_dir, SideConfig(block_size=32), SideConfig(block_size=16, kv_salt=1)
        )
        shared = make_prompt(9)[:16]
        run_local(consumer, "local", shared + make_prompt(10)[:20])
        prompt = shared + make_prompt(11)[: PROMPT_LEN - 16]
        params = produce(producer, "r", prompt)
        result = consume(consumer, producer, "r", prompt, params, fault=fault)
        assert result.num_local_tokens == 16
        assert result.recv_blocks.groups[0][0] == 1
        if fault is None:
            assert verdicts(consumer) == {"verified": 1}
        else:
            assert verdicts(consumer) == {"mismatch": 1}
        assert result.finish_reason == "length"


# --------------------------------------------------------------------------
# Corruption (R92-R96, R131)
# --------------------------------------------------------------------------


@SCHEDULERS
@pytest.mark.parametrize("mode", list(MODES))
def test_corrupted_byte(
    model_dir: str, vllm_caplog, mode: str, async_scheduler: bool
) -> None:
    """R92-R96: one flipped bit on the consumer's second TP rank in loaded block 1
    is a mismatch at exactly that position: fail-open logs the error and uses
    the KV; fail-closed + "fail" ends the request with an error; fail-closed +
    "recompute" resets num_computed_tokens and computes the prompt locally.
    Catches disabling the comparison or not failing mismatches fail-closed."""
    producer, consumer = engines(
        model_dir,
        SideConfig(async_scheduler=async_scheduler),
        mode_config(mode, tp=2, async_scheduler=async_scheduler),
    )
    prompt = make_prompt(12)
    params = produce(producer, "r", prompt)
    result = consume(
        consumer, producer, "r", prompt, params, fault=Fault("bit_flip", 1, worker=1)
    )
    assert verdicts(consumer) == {"mismatch": 1}
    assert consumer.checksums.stats.mismatched_positions == 1
    assert mismatch_positions(vllm_caplog, "r") == {0: [1]}
    # No unverified warning for a mismatching load (R96).
    assert not [m for m in messages(vllm_caplog, logging.WARNING) if "KV checksum" in m]
    assert_outcome(result, consumer, mode)


@pytest.mark.parametrize(
    ("tp", "worker"), [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
)
def test_corrupted_byte_on_each_rank(
    model_dir: str, vllm_caplog, tp: int, worker: int
) -> None:
    """R91-R92 (issue 32): one flipped bit on any single consumer TP rank (at
    TP 4 each KV head has two replicas) is a mismatch at exactly its position.
    Catches a comparison in which only one rank (the last, or the first
    replica) counts: corruption on the others would come back verified."""
    producer, consumer = engines(model_dir, SideConfig(), SideConfig(tp=tp))
    prompt = make_prompt(13)
    params = produce(producer, "r", prompt)
    consume(
        consumer,
        producer,
        "r",
        prompt,
        params,
        fault=Fault("bit_flip", 2, worker=worker),
    )
    assert verdicts(consumer) == {"mismatch": 1}
    assert mismatch_positions(vllm_caplog, "r") == {0: [2]}


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_fault_kinds_are_mismatches(model_dir: str, vllm_caplog, kind: str) -> None:
    """R131, R92: a flipped bit, a zeroed block, two swapped blocks and a block
    of another request (a stale read) are each a mismatch at the corrupted
    positions. Catches a comparison blind to position (swaps), to zeroes, or
    to well-formed KV of another request."""
    producer, consumer = engines(model_dir, SideConfig(tp=2), SideConfig(pp=2))
    prompt = make_prompt(13)
    stale = (
        produce(producer, "stale", make_prompt(14)) if kind == "stale_block" else None
    )
    params = produce(producer, "r", prompt)
    fault = Fault(kind, position=2, other_position=0)
    consume(consumer, producer, "r", prompt, params, fault=fault, stale_params=stale)
    expected = [0, 2] if kind == "swap_blocks" else [2]
    assert verdicts(consumer) == {"mismatch": 1}
    assert mismatch_positions(vllm_caplog, "r") == {0: expected}


@pytest.mark.parametrize("kind", ["bit_flip", "zero_block"])
def test_whole_prompt_load_checks_last_block(
    model_dir: str, vllm_caplog, kind: str
) -> None:
    """R64, R68, R90: a connector loading the whole prompt (NIXL pull in vLLM
    0.33.0; vLLM recomputes the last token afterwards) writes the last, partial
    block (tokens 48-59) with as many tokens as the producer checksummed, so an
    intact load verifies fail-closed and a fault there is a mismatch. Catches a
    producer checksumming fewer tokens than it computed (the last loaded block
    then never compared)."""
    side = SideConfig(connector=WHOLE_PROMPT_CONNECTOR_NAME)
    producer, consumer = engines(
        model_dir, side, dataclasses.replace(side, fail_closed=True)
    )
    prompt = make_prompt(21)
    intact = produce(producer, "intact", prompt)
    result = consume(consumer, producer, "intact", prompt, intact)
    assert result.num_loaded_tokens == PROMPT_LEN
    # vLLM recomputes the last prompt token, then decodes one more.
    assert consumer.scheduled_tokens("intact") == 2
    assert result.finish_reason == "length"
    assert verdicts(consumer) == {"verified": 1}

    params = produce(producer, "r", prompt)
    fault = Fault(kind, position=3)
    result = consume(consumer, producer, "r", prompt, params, fault=fault)
    assert verdicts(consumer) == {"verified": 1, "mismatch": 1}
    assert mismatch_positions(vllm_caplog, "r") == {0: [3]}
    assert result.finish_reason == "error"


def test_failed_load_is_not_compared(model_dir: str, vllm_caplog) -> None:
    """R73, R75: a load the connector reports failed is known bad: neither
    compared nor counted (vLLM's kv_load_failure_policy alone handles it, here
    "recompute"). Nothing was transferred, so comparing it would log a false
    mismatch. Catches verifying loads vLLM already failed."""
    producer, consumer = engines(
        model_dir, SideConfig(), SideConfig(policy="recompute")
    )
    prompt = make_prompt(19)
    params = produce(producer, "r", prompt)
    consumer.add(make_request("r", prompt, max_tokens=2, kv_transfer_params=params))
    consumer.step()
    assert consumer.recv_blocks("r") is not None
    consumer.finish_load("r", failed=True)
    consumer.step()
    assert str(consumer.run("r").finish_reason) == "length"
    assert consumer.scheduled_tokens("r") == PROMPT_LEN + 1
    assert verdicts(consumer) == {}
    assert not messages(vllm_caplog, logging.ERROR)


# --------------------------------------------------------------------------
# Preemption and abort (R68, R74, R75)
# --------------------------------------------------------------------------


def test_preempted_producer_checksums_its_reprefill(model_dir: str) -> None:
    """R68, R75: a producer preempted in the middle of its prefill registers
    its send only in the re-prefill's last step, over the whole prompt (its
    prefix-cache hit included), and sends what an unpreempted producer sends;
    the load verifies fail-closed. Eight blocks and 16-token steps make vLLM
    preempt it when a decoding request needs a block. Catches checksumming
    only the blocks the re-prefill computed, or blocks from before the
    preemption."""
    preempting = SimEngine(
        model_dir, SideConfig(max_num_batched_tokens=16, num_blocks=8), "Pp"
    )
    whole = SimEngine(model_dir, SideConfig(), "P1")
    consumer = SimEngine(model_dir, SideConfig(fail_closed=True), "D")
    prompt = make_prompt(23)
    preempting.add(make_request("busy", make_prompt(24, 47), max_tokens=10))
    params = produce(preempting, "r", prompt)
    preempted = [o for o in preempting.history if "r" in (o.preempted_req_ids or ())]
    assert preempted, "the producer request was not preempted"
    steps = [o.num_scheduled_tokens.get("r", 0) for o in preempting.history]
    preempted_at = steps.index(0, steps.index(next(n for n in steps if n)))
    assert 0 < sum(steps[:preempted_at]) < PROMPT_LEN  # preempted mid-prefill
    sends = [o for o in preempting.history if o.kv_checksum_scheduled is not None]
    last_prefill = max(i for i, n in enumerate(steps) if n)
    assert len(sends) == 1 and sends[0] is preempting.history[last_prefill]
    expected = KVChecksumPayload.from_base64(
        produce(whole, "r", prompt)[KV_TRANSFER_PARAMS_KEY]
    )
    assert_whole_prompt_payload(params, expected)
    result = consume(consumer, preempting, "r", prompt, params)
    assert verdicts(consumer) == {"verified": 1}
    assert result.finish_reason == "length"


def test_aborted_load_is_dropped(model_dir: str, vllm_caplog) -> None:
    """R74, R75: a consumer request aborted while its load runs is dropped by
    the checksum scheduler and the workers: the load finishing afterwards is
    neither compared nor counted, nothing is logged, and no state is kept for
    it. Catches the checksum scheduler verifying (or keeping pending) loads of
    aborted requests; the workers' side is test_abort_while_loading_dropped in
    test_kv_checksum.py."""
    producer, consumer = engines(model_dir, SideConfig(), SideConfig(fail_closed=True))
    prompt = make_prompt(25)
    params = produce(producer, "r", prompt)
    consumer.add(make_request("r", prompt, max_tokens=2, kv_transfer_params=params))
    consumer.step()
    assert consumer.recv_blocks("r") is not None
    consumer.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    consumer.finish_load("r")
    consumer.step()
    consumer.step()
    assert verdicts(consumer) == {}
    assert not consumer.checksums.consumer._recvs
    assert not consumer.checksums.consumer._noted
    assert all(not w.checksum._to_recv for w in consumer.workers)
    logged = messages(vllm_caplog, logging.WARNING) + messages(
        vllm_caplog, logging.ERROR
    )
    assert not [m for m in logged if "KV checksum" in m]
    # The engine goes on: the same prompt loads and verifies afterwards.
    params = produce(producer, "r2", prompt)
    assert consume(consumer, producer, "r2", prompt, params).finish_reason == "length"
    assert verdicts(consumer) == {"verified": 1}


# --------------------------------------------------------------------------
# Missing and malformed checksums (R70, R79, R82, R94-R96)
# --------------------------------------------------------------------------


def _nested_msgpack() -> str:
    # [2, 0, [[[[...]]]]]: version 2 envelope, then 100k nested arrays.
    depth = 100_000
    return base64.b64encode(b"\x93\x02\x00" + b"\x91" * depth + b"\x90").decode()


BAD_PAYLOADS = {
    "missing": (None, NO_CHECKSUMS),
    "garbage-base64": (lambda: "not base64 at all!*", INVALID),
    "deeply-nested": (_nested_msgpack, INVALID),
    "oversized": (lambda: "A" * (DEFAULT_MAX_ENCODED_BYTES + 4), INVALID),
    "other-version": (
        # A version 1 payload (an older producer): "unsupported version 1".
        lambda: base64.b64encode(msgspec.msgpack.encode([1, 1, 60, []])).decode(),
        INVALID,
    ),
    "not-a-string": (lambda: 12345, INVALID),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(BAD_PAYLOADS))
def test_missing_or_malformed_checksums(
    model_dir: str, vllm_caplog, case: str, mode: str
) -> None:
    """R70, R79, R82, R94-R96: a load whose params lack "kv_checksums", or carry
    garbage base64, a deeply nested msgpack payload, an oversized string,
    another version or a non-string, is unverified ("sent no checksums" / "are
    invalid", warned once): used fail-open, an error with "fail", recomputed
    with "recompute"; no exception escapes the scheduler. Catches decode
    errors escaping, and treating missing checksums as verified."""
    make_value, expected = BAD_PAYLOADS[case]
    producer, consumer = engines(model_dir, SideConfig(), mode_config(mode))
    prompt = make_prompt(15)
    params = produce(producer, "r", prompt)
    del params[KV_TRANSFER_PARAMS_KEY]
    if make_value is not None:
        params[KV_TRANSFER_PARAMS_KEY] = make_value()
    result = consume(consumer, producer, "r", prompt, params)
    assert verdicts(consumer) == {"unverified": 1}
    warnings = [m for m in messages(vllm_caplog, logging.WARNING) if "KV checksum" in m]
    assert warnings == [expected]
    assert not messages(vllm_caplog, logging.ERROR)
    assert_outcome(result, consumer, mode)


def test_window_blocks_freed_before_the_transfer_are_not_sent(model_dir: str) -> None:
    """R66, R135: a sliding-window producer checksums its last
    ceil(window / bs) + 1 blocks when the prompt ends, but vLLM frees the
    earliest of them before the request finishes (tokens before N - window + 1
    are skipped), so the consumer cannot load it. The payload leaves that
    block's chunks out and the load verifies. Found by the full matrix run
    (prompt 80, window 32, producer bs 16, consumer bs 32 after a 32-token
    local hit): sending it was a false mismatch at consumer position 1."""
    producer, consumer = engines(
        model_dir,
        SideConfig(block_size=16, groups="sliding"),
        SideConfig(block_size=32, groups="sliding", kv_salt=1),
    )
    prompt = make_prompt(21, 80)
    run_local(consumer, "local", prompt[:40] + make_prompt(22, 5))
    params = produce(producer, "r", prompt)
    sent = producer.sent_blocks("r").groups[0]
    held = per_group(params["remote_block_ids"])[0]
    assert sent[0] == 2 and held[2] == producer.null_block  # freed since
    payload = KVChecksumPayload.from_base64(params[KV_TRANSFER_PARAMS_KEY])
    assert [(g.start, len(g.values)) for g in payload.groups] == [(3, 2)]
    result = consume(consumer, producer, "r", prompt, params)
    assert result.num_local_tokens == 32
    assert verdicts(consumer) == {"verified": 1}


# --------------------------------------------------------------------------
# Block sizes (R88-R92)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "bit-flip"])
@pytest.mark.parametrize(
    "producer_bs,consumer_bs", [(16, 32), (32, 16)], ids=["16to32", "32to16"]
)
def test_block_sizes_differ(
    model_dir: str, vllm_caplog, producer_bs: int, consumer_bs: int, corrupt: bool
) -> None:
    """R88-R92: producer and consumer block sizes 16/32 and 32/16 compare
    32-token chunks: an intact load verifies (fail-closed) and a bit flip in the
    consumer's last loaded block is reported at every loaded consumer position
    of the bad chunk. Catches comparing unsummed blocks across block sizes."""
    # 65 tokens: the consumer loads 64, two full 32-token chunks on both sides.
    length = 65
    producer, consumer = engines(
        model_dir,
        SideConfig(block_size=producer_bs),
        SideConfig(block_size=consumer_bs, fail_closed=not corrupt),
    )
    prompt = make_prompt(16, length)
    params = produce(producer, "r", prompt)
    last = (length - 2) // consumer_bs
    fault = Fault("bit_flip", position=last) if corrupt else None
    result = consume(consumer, producer, "r", prompt, params, fault=fault)
    if not corrupt:
        assert verdicts(consumer) == {"verified": 1}
        assert result.finish_reason == "length"
        return
    assert verdicts(consumer) == {"mismatch": 1}
    # Producers send 16-token chunks (R135): a 16-token consumer block is
    # localized on its own even against 32-token producer blocks.
    expected = [1] if consumer_bs == 32 else [3]
    assert mismatch_positions(vllm_caplog, "r") == {0: expected}


# --------------------------------------------------------------------------
# Skipped groups (R34, R86)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("skipped_on", ["both", "producer", "consumer"])
def test_skipped_groups(model_dir: str, vllm_caplog, skipped_on: str) -> None:
    """R86: with a full-attention and a sliding-window group, the sliding group
    skipped by every worker on both sides is not compared and the load verifies
    fail-closed on the other group; skipped on one side only the load is
    unverified ("checksummed by one side only"). Workers skip the group because
    they are built without its caches (SideConfig.uncovered_groups, R34).
    Catches failing hybrid loads over a group neither side can checksum, and
    verifying a load whose group one side left out."""
    skip = (1,)
    producer, consumer = engines(
        model_dir,
        SideConfig(
            tp=2,
            groups="both",
            uncovered_groups=skip if skipped_on != "consumer" else (),
        ),
        SideConfig(
            pp=2,
            groups="both",
            fail_closed=skipped_on == "both",
            uncovered_groups=skip if skipped_on != "producer" else (),
        ),
    )
    prompt = make_prompt(17)
    params = produce(producer, "r", prompt)
    payload = KVChecksumPayload.from_base64(params[KV_TRANSFER_PARAMS_KEY])
    sent_groups = [g.group_id for g in payload.groups]
    assert sent_groups == ([0, 1] if skipped_on == "consumer" else [0])
    result = consume(consumer, producer, "r", prompt, params)
    assert result.recv_blocks is not None
    assert sorted(result.recv_blocks.groups) == [0, 1]
    assert result.finish_reason == "length"
    warnings = [m for m in messages(vllm_caplog, logging.WARNING) if "verified" in m]
    if skipped_on == "both":
        assert verdicts(consumer) == {"verified": 1}
        assert warnings == []
    else:
        assert verdicts(consumer) == {"unverified": 1}
        assert warnings == [ONE_SIDE]


# --------------------------------------------------------------------------
# Carriers (R15, R16, R97-R102)
# --------------------------------------------------------------------------


def test_carrier_less_connector_refused_fail_closed(model_dir: str) -> None:
    """R15: enable_kv_checksum with a connector declaring no carrier (the plain
    test connector) is refused fail-closed: no load could ever verify. Catches
    silently running fail-closed without a carrier (every load failing)."""
    with pytest.raises(ValueError, match="declares no carrier"):
        SimEngine(
            model_dir, SideConfig(connector=TEST_CONNECTOR_NAME, fail_closed=True), "D"
        )


def test_carrier_less_connector_disabled_fail_open(
    model_dir: str, vllm_caplog, monkeypatch
) -> None:
    """R15, R16: fail-open, a connector without carrier disables checksums with
    a warning: no checksum scheduler, nothing sent, loads run as without the
    plugin. Catches sending or verifying through a connector that cannot carry
    them."""
    monkeypatch.setattr(checksum_config, "_warned", set())
    side = SideConfig(connector=TEST_CONNECTOR_NAME)
    producer, consumer = engines(model_dir, side, side)
    assert producer.scheduler.kv_checksum_scheduler is None
    assert consumer.scheduler.kv_checksum_scheduler is None
    assert (
        f"KV checksums disabled: connector {TEST_CONNECTOR_NAME} declares no "
        "carrier for them."
    ) in messages(vllm_caplog, logging.WARNING)
    prompt = make_prompt(18)
    params = produce(producer, "r", prompt)
    assert KV_TRANSFER_PARAMS_KEY not in params
    result = consume(consumer, producer, "r", prompt, params)
    assert result.finish_reason == "length"
    assert result.recv_blocks is None


def test_nixl_pull_carrier() -> None:
    """R102: NIXL pull carries checksums in kv_transfer_params for producer
    requests and regular loads, and not for a bidirectional load (its source
    sent none). Catches NIXL pull declaring no carrier (nothing ever sent or
    verified over NIXL)."""
    register_plugin()
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPullConnector,
    )

    carrier = NixlPullConnector.kv_checksum_carrier
    producer = make_request(
        "p", [5] * 20, kv_transfer_params={"do_remote_decode": True}
    )
    consumer = make_request(
        "d", [5] * 20, kv_transfer_params={"do_remote_prefill": True}
    )
    both = make_request(
        "b",
        [5] * 20,
        kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": True},
    )
    plain = make_request("x", [5] * 20)
    params = KVChecksumCarrier.KV_TRANSFER_PARAMS
    assert carrier(None, producer, False) is params
    assert carrier(None, consumer, True) is params
    assert carrier(None, both, True) is None
    assert carrier(None, plain, False) is None


def _declares(name: str, **extra: Any) -> bool:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra
    )
    return checksum_config.connector_declares_carrier(config)


def test_connector_declares_carrier() -> None:
    """R100, R101: NixlConnector, NixlPullConnector and a MultiConnector with a
    NIXL child declare a carrier; the plain test connector does not. Catches
    enabling checksums on a connector that cannot carry them or refusing NIXL
    pull."""
    register_plugin()
    nixl_child = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    plain_child = {"kv_connector": TEST_CONNECTOR_NAME, "kv_role": "kv_both"}
    assert _declares("NixlConnector")
    assert _declares("NixlPullConnector")
    assert _declares(CARRIER_CONNECTOR_NAME)
    assert _declares("MultiConnector", connectors=[plain_child, nixl_child])
    assert not _declares(TEST_CONNECTOR_NAME)
    assert not _declares("MultiConnector", connectors=[plain_child])


def test_nixl_push_declares_carrier() -> None:
    """R103: NixlPushConnector declares a carrier. Catches refusing NIXL push."""
    register_plugin()
    skip_unless_capability("nixl_push")
    assert _declares("NixlPushConnector")


def test_R71_a_steps_record_keeps_its_own_empty_parts() -> None:
    """R71, R142: no part of a step's record, empty parts included, is a dict
    the producer or consumer writes to later: a load registered in the next
    step (while a worker may still read this step's record, with async
    scheduling) must not appear in it. Bug caught (tried): step dicts reset
    only when they held something, and the record built from the live empty
    ones (bb2a874)."""
    import numpy as np

    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumBlocks,
    )
    from vllm.distributed.kv_transfer.kv_checksum.engine.consumer import (
        KVChecksumConsumer,
    )
    from vllm.distributed.kv_transfer.kv_checksum.engine.producer import (
        KVChecksumProducer,
    )
    from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
        KVChecksumScheduler,
    )

    kcs = object.__new__(KVChecksumScheduler)
    kcs.consumer = object.__new__(KVChecksumConsumer)
    kcs.consumer._step_recvs, kcs.consumer._step_loads = {}, {}
    kcs.producer = object.__new__(KVChecksumProducer)
    kcs.producer._step = {}
    assert kcs.build_checksum_meta() is None

    blocks = KVChecksumBlocks(16, {0: (0, np.array([3]))})
    kcs.producer._step["producer"] = blocks  # as add_send does
    first = kcs.build_checksum_meta()
    assert first is not None and list(first.reqs_to_send) == ["producer"]
    kcs.consumer._step_recvs["consumer"] = blocks  # next step, as add_recv does
    kcs.consumer._step_loads["offload"] = blocks
    assert first.reqs_to_recv == {} and first.reqs_to_load == {}
    second = kcs.build_checksum_meta()
    assert second is not None and second.reqs_to_send == {}
    assert list(second.reqs_to_recv) == ["consumer"]
    assert list(second.reqs_to_load) == ["offload"]
    assert kcs.build_checksum_meta() is None


def test_scheduler_groups_hold_all_blocks_for_full_attention_only() -> None:
    """R66, R142: only exact full-attention and MLA groups are marked as
    holding every block until the request is freed; sliding-window,
    chunked-local and full-attention subclasses (sink tokens) may free
    blocks earlier, so a finishing producer keeps checking those. Bug caught:
    an `isinstance(spec, FullAttentionSpec)` test, which also matches
    subclasses with other allocation rules."""
    import torch

    from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
        _transfer_groups,
    )
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )

    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 8}
    specs = [
        FullAttentionSpec(**common, dtype=torch.float16),
        MLAAttentionSpec(**common, dtype=torch.float16),
        SlidingWindowSpec(**common, dtype=torch.float16, sliding_window=32),
        ChunkedLocalAttentionSpec(
            **common, dtype=torch.float16, attention_chunk_size=32
        ),
        SinkFullAttentionSpec(**common, dtype=torch.float16, sink_len=4),
    ]
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
        ],
    )
    groups = _transfer_groups(config)
    assert {g: s.holds_all_blocks for g, s in groups.items()} == {
        0: True,
        1: True,
        2: False,
        3: False,
        4: False,
    }
