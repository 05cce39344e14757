# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Containment of loads that failed verification (R138), on vLLM 0.33.0's real
Scheduler and KV cache manager.

Request A loads a 72-token prompt from a producer (the test connector loads 71
tokens: block positions 0-4, 0-3 full) and one position is corrupted before
the load is reported. Other requests share A's prefix and arrive before,
during, at the verdict of or after the bad load; each test checks, after
every engine step:

- the hash invariant: none of A's blocks from the first bad position on (all
  groups, A's later decode blocks included) holds a prefix-cache hash while A
  holds it, so no lookup can ever return it (A's freed blocks are then
  unhashed and reused as fresh blocks);
- the content oracle: every prefix-cache hit another request gets holds the
  correct KV (the simulated forward writes KV as a fixed function of token and
  position, so a hit on the corrupted block is visible);
- the hit counts: what the other requests get from the prefix cache.

A decodes 26 tokens, so its blocks 4 (tokens 64-79, partly loaded) and 5
(80-95, never loaded) fill with KV computed over the bad load: "the later
blocks of that request". The second request (R2) and the third (R3) carry
A's prompt, A's first 24 output tokens (the simulated model always samples
100) and 8 more tokens, so their lookups can reach A's block 5.

Plausible bugs and the tests they fail (each verified by introducing it):

- quarantining only the mismatched position, not the later ones: the hash
  invariant of every fail-open test and of
  `test_blocks_cached_before_the_verdict_are_evicted`;
- quarantining the loaded blocks but not the blocks A computes later (block
  5): the hash invariant of every fail-open test except the preemption one;
- no containment after vLLM caches a request's blocks (verdict-time eviction
  only): every fail-open test;
- acting only fail-closed: every fail-open test; acting only fail-open: every
  fail-closed test (behaviourally only
  `test_blocks_cached_before_the_verdict_are_evicted[fail-closed-*]`: vLLM
  0.33.0 itself never caches a failed async load's blocks before freeing
  them, the other fail-closed tests fail on the quarantine counts);
- evicting every block with a quarantined hash instead of A's own blocks:
  R3's full hit of R2's clean copies (`during`, `at-verdict`, async);
- keeping the quarantine after vLLM freed the blocks: the recomputed blocks
  never serve (`test_fail_closed_recompute_contained[during|after]`,
  `test_preempted_fail_open_request_recomputes_and_caches`, the recompute
  cases of the two other fail-closed tests);
- quarantining only the group the mismatch was reported in:
  `test_fail_open_hybrid_groups`;
- quarantining unverified fail-open loads, or verified loads:
  `test_unverified_fail_open_load_cached_as_without_checksums`,
  `test_clean_load_cached_as_without_checksums`;
- a second failed load of A replacing A's quarantine start instead of keeping
  the earlier one, or the first start kept whatever comes after:
  `test_second_failed_load_keeps_the_earlier_start`.

`test_without_containment_the_bad_load_spreads` runs the same scenario with
containment turned off (checksums and the mismatch still on) and shows R2
reading the corrupted block: the oracles can see a spread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    Fault,
    SideConfig,
    SimEngine,
    apply_fault,
    kv_bytes,
    per_group,
    produce,
    transfer,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import (
    containment as containment_mod,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    containment as wiring_containment,
)
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
PROMPT_LEN = 72  # loaded: 71 tokens, block positions 0-4 (0-3 full)
LOADED_POSITIONS = 5
# A fills blocks 4 (tokens 64-79, 71-79 computed) and 5 (80-95, never loaded)
# with KV computed over the load.
A_TOKENS = 26
SAMPLED = 100  # the token the simulated model samples
BAD = 1  # the corrupted loaded position

# consumer mode -> (kv_checksum_fail_closed, kv_load_failure_policy)
MODES = {
    "fail-open": (False, "fail"),
    "fail-closed-fail": (True, "fail"),
    "fail-closed-recompute": (True, "recompute"),
}
ARRIVALS = ["before", "during", "at-verdict", "after"]


def make_prompt(seed: int, length: int) -> list[int]:
    """Distinct token ids (3..999, never eos or 100) for a seed."""
    tokens = [(seed * 389 + 37 * i + (i * i) % 11) % 997 + 3 for i in range(length)]
    return [t if t != SAMPLED else 101 for t in tokens]


PROMPT = make_prompt(1, PROMPT_LEN)
# A's prompt, A's first 24 outputs, 8 more tokens: reaches A's block 5.
EXTENDED = PROMPT + [SAMPLED] * 24 + make_prompt(2, 8)
FULL_HIT = 6 * BS  # blocks 0-5 of EXTENDED


def mode_side(mode: str, **kwargs: Any) -> SideConfig:
    fail_closed, policy = MODES[mode]
    return SideConfig(fail_closed=fail_closed, policy=policy, **kwargs)


@dataclasses.dataclass
class Watch:
    """A's quarantined blocks and every prefix-cache hit other requests got."""

    consumer: SimEngine
    # group -> first quarantined position of A while A's blocks are watched
    # (fail-open: while A holds them; fail-closed: until vLLM frees them)
    start: dict[int, int] | None = None
    # A's quarantine as set at the verdict
    quarantine: dict[int, int] | None = None
    hits: dict[str, int] = dataclasses.field(default_factory=dict)
    # request id -> its hit block ids per group, as first scheduled
    hit_blocks: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    # A's loaded blocks (group 0) with a prefix-cache hash right after the verdict
    hashed_after_verdict: list[int] = dataclasses.field(default_factory=list)

    def step(self) -> None:
        output = self.consumer.step()
        for new in output.scheduled_new_reqs:
            if new.req_id == "A":
                continue
            load = self.consumer.loads.get(new.req_id)
            loaded = load.num_external_tokens if load is not None else 0
            # A loaded request's local hit is what it had before its load.
            self.hits[new.req_id] = max(0, new.num_computed_tokens - loaded)
            ids = per_group(new.block_ids)
            self.hit_blocks[new.req_id] = [
                g[: new.num_computed_tokens // BS] for g in ids
            ]
            assert_hit_content(self.consumer, new.req_id, new.num_computed_tokens)
        self.check_invariant()

    def check_invariant(self) -> None:
        """No block of A at a quarantined position has a prefix-cache hash."""
        if self.start is None:
            return
        request = self.consumer.scheduler.requests.get("A")
        if request is None or request.is_finished():
            return
        if (
            self.consumer.side.fail_closed
            and request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        ):
            # vLLM freed the failed load's blocks; A recomputes into new ones.
            self.start = None
            return
        pool = self.consumer.scheduler.kv_cache_manager.block_pool
        tables = self.consumer.block_ids("A")
        for group, first in self.start.items():
            for pos, block_id in enumerate(tables[group][first:], first):
                block = pool.blocks[block_id]
                assert block.is_null or block.block_hash is None, (
                    f"A's block {block_id} (group {group} position {pos}) is "
                    "in the prefix cache"
                )

    def run(self, *req_ids: str, max_steps: int = 60) -> None:
        for _ in range(max_steps):
            if all(r in self.consumer.final for r in req_ids):
                return
            self.step()
        raise AssertionError(f"{req_ids} did not finish in {max_steps} steps")


def assert_hit_content(engine: SimEngine, req_id: str, num_hit: int) -> None:
    """The KV of a request's prefix-cache hit equals the correct KV."""
    if num_hit == 0:
        return
    request = engine.scheduler.requests[req_id]
    tokens = np.asarray(request.all_token_ids[:num_hit])
    for group, block_ids in enumerate(engine.block_ids(req_id)):
        # Null blocks (out of a sliding window) hold nothing to read.
        positions = np.asarray(
            [p for p in range(num_hit) if block_ids[p // BS] != engine.null_block]
        )
        if positions.size == 0:
            continue
        for (layer, head), got in engine.read_global(
            block_ids, positions.tolist(), group
        ).items():
            want = kv_bytes(tokens[positions], positions, layer, head, got.shape[1])
            wrong = positions[(got != want).any(1)]
            bad = sorted({int(p) // BS for p in wrong})
            assert not bad, f"{req_id} read wrong KV at block positions {bad}"


def start_load(
    consumer: SimEngine,
    producer: SimEngine,
    req_id: str,
    prompt: list[int],
    fault: Fault | None,
    max_tokens: int = A_TOKENS,
    drop_checksums: bool = False,
) -> None:
    """Add a consumer request, start its load, copy (and corrupt) its KV; the
    load is reported finished with `consumer.finish_load`."""
    params = produce(producer, f"p-{req_id}", prompt)
    if drop_checksums:
        del params[KV_TRANSFER_PARAMS_KEY]
    consumer.add(
        make_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params)
    )
    consumer.step()
    load = consumer.loads[req_id]
    request = consumer.scheduler.requests[req_id]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    end = request.num_computed_tokens
    positions = list(range(end - load.num_external_tokens, end))
    blocks = per_group(load.block_ids)
    remote = per_group(params["remote_block_ids"])
    copied = transfer(producer, remote, consumer, blocks, positions)
    if fault is not None:
        apply_fault(consumer, blocks[fault.group], copied[fault.group], fault)


def add_local(engine: SimEngine, req_id: str, prompt: list[int] = EXTENDED) -> None:
    engine.add(make_request(req_id, prompt, max_tokens=2))


@pytest.fixture
def info_caplog(vllm_caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    vllm_caplog.set_level(logging.INFO)
    return vllm_caplog


def quarantine_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("KV checksums: quarantined")
    ]


def engines(model_dir: str, consumer: SideConfig) -> tuple[SimEngine, SimEngine]:
    producer = SimEngine(model_dir, SideConfig(groups=consumer.groups), "P")
    return producer, SimEngine(model_dir, consumer, "D")


def run_bad_load(
    model_dir: str,
    mode: str,
    arrival: str,
    fault: Fault | None = None,
    expected: dict[int, int] | None = None,
    **side: Any,
) -> Watch:
    """A's load, corrupted by `fault` (default: a bit flip at BAD), with R2
    arriving `arrival` the bad load and R3 after R2 finished.

    before: R2 is another consumer request of A's prompt, started while A's
    load runs; its clean load is reported one step after A's bad one.
    during: R2 (local) arrives while A's load runs: it computes the prefix
    itself, before A's blocks could be cached.
    at-verdict: R2 (local) arrives right after A's verdict; its first lookup
    comes in the schedule() that promotes A (fail-closed: frees it).
    after: R2 (local) arrives after A finished.
    """
    fault = fault if fault is not None else Fault("bit_flip", BAD)
    producer, consumer = engines(model_dir, mode_side(mode, **side))
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, fault)
    if arrival == "before":
        start_load(consumer, producer, "R2", PROMPT, None)
    if arrival == "during":
        add_local(consumer, "R2")
    consumer.finish_load("A")
    # The invariant is checked against the expected quarantine.
    watch.start = dict(expected) if expected is not None else {0: BAD}
    watch.step()  # A's verdict
    watch.quarantine = consumer.scheduler.kv_checksum_containment.start("A")
    pool = consumer.scheduler.kv_cache_manager.block_pool
    watch.hashed_after_verdict = [
        b
        for b in per_group(consumer.loads["A"].block_ids)[0]
        if pool.blocks[b].block_hash is not None
    ]
    if arrival == "before":
        consumer.finish_load("R2")
    if arrival == "at-verdict":
        add_local(consumer, "R2")
    watch.check_invariant()
    if arrival == "after":
        watch.run("A")
        add_local(consumer, "R2")
    watch.run("A", "R2")
    add_local(consumer, "R3")
    watch.run("R3")
    return watch


# --------------------------------------------------------------------------
# The plain rules
# --------------------------------------------------------------------------


def test_quarantine_start_is_the_first_bad_token_in_every_group() -> None:
    """R138: a mismatch quarantines, in every group, the block holding the
    first bad token and all later blocks; an unverified load is quarantined
    from its first loaded position fail-closed and not at all fail-open; a
    verified load never. Catches quarantining only the mismatching group, or
    only the reported positions."""
    sizes = {0: 16, 1: 32}
    blocks = KVChecksumBlocks(
        num_tokens=200,
        groups={0: (2, np.arange(10, 20)), 1: (1, np.arange(30, 35))},
    )
    mismatch = KVChecksumVerdict(KVChecksumStatus.MISMATCH, {0: [7, 9], 1: [4]})
    first = containment_mod.first_bad_positions(mismatch, blocks, fail_closed=False)
    assert first == {0: 7, 1: 4}
    # Group 0's position 7 starts at token 112, group 1's position 4 at 128.
    start = containment_mod.quarantine_start(first, sizes)
    assert start == {0: 7, 1: 3}
    # Loaded group 0 positions 2-11: 7-11 quarantined; group 1 1-5: 3-5.
    assert containment_mod.count_quarantined(blocks, start) == 5 + 3
    table = [list(range(100, 112)), [0, 0, 0, 41, 42, 43]]
    ids = containment_mod.quarantined_block_ids(table, start)
    assert ids.tolist() == [107, 108, 109, 110, 111, 41, 42, 43]

    unverified = KVChecksumVerdict(KVChecksumStatus.UNVERIFIED)
    assert containment_mod.first_bad_positions(unverified, blocks, True) == {
        0: 2,
        1: 1,
    }
    assert containment_mod.first_bad_positions(unverified, blocks, False) == {}
    verified = KVChecksumVerdict(KVChecksumStatus.VERIFIED)
    assert containment_mod.first_bad_positions(verified, blocks, True) == {}
    assert containment_mod.quarantine_start({}, sizes) == {}


def test_hybrid_quarantine_starts_after_a_local_prefix_hit() -> None:
    """R138, issue 32 item 3: a hybrid (attention + Mamba) load after a local
    prefix hit of 2 blocks registers attention from position 2 and the Mamba
    running-state block at position 0 (one per request, never shared). A bad
    state, a bad attention block, or an unverified fail-closed load
    quarantines from position 2 at the earliest, so the two shared hit blocks
    keep their hashes. Bug caught: the Mamba block's position 0 taken as a
    token (quarantine from token 0 in every group: every hit block of the
    request loses its hash)."""
    sizes = {0: 32, 1: 32, 2: 32}  # attention 0, Mamba 1 and 2
    state = {1, 2}
    blocks = KVChecksumBlocks(
        num_tokens=5 * 32,
        groups={0: (2, np.arange(12, 15)), 1: (0, np.array([40])), 2: (0, [41])},
    )
    cases = [
        ({1: [0]}, {0: 2, 1: 2, 2: 2}),  # the state only: from the load's start
        ({0: [3], 2: [0]}, {0: 3, 1: 3, 2: 3}),  # attention sets the start
    ]
    for mismatches, expected in cases:
        verdict = KVChecksumVerdict(KVChecksumStatus.MISMATCH, mismatches)
        containment = containment_mod.KVChecksumContainment(
            sizes, False, state_groups=state
        )
        assert containment.on_failed_load("r", verdict, blocks) == expected
    unverified = KVChecksumVerdict(KVChecksumStatus.UNVERIFIED)
    containment = containment_mod.KVChecksumContainment(sizes, True, state_groups=state)
    assert containment.on_failed_load("r", unverified, blocks) == {0: 2, 1: 2, 2: 2}
    # A pure Mamba model has only state groups: position 0 it is.
    only = KVChecksumBlocks(num_tokens=64, groups={1: (0, np.array([40]))})
    pure = containment_mod.KVChecksumContainment({1: 32}, False, state_groups={1})
    verdict = KVChecksumVerdict(KVChecksumStatus.MISMATCH, {1: [0]})
    assert pure.on_failed_load("r", verdict, only) == {1: 0}


# --------------------------------------------------------------------------
# Fail-open: A runs on its KV, nobody else reads the bad part
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_fail_open_mismatch_contained(
    model_dir: str, info_caplog, arrival: str
) -> None:
    """R138, R94: fail-open, a bit flip at loaded position 1 is a mismatch; A
    still runs on its loaded KV, but its blocks from position 1 on (its
    decode-filled blocks 4 and 5 included) never hold a prefix-cache hash, so the
    second request gets exactly block 0 from the cache (before: nothing, its
    own load ran first) and the third, after R2 computed the rest itself, a
    full hit of clean copies. Bugs caught: see the module docstring."""
    watch = run_bad_load(model_dir, "fail-open", arrival)
    consumer = watch.consumer
    assert dict(consumer.checksums.stats.loads) == (
        {"mismatch": 1, "verified": 1} if arrival == "before" else {"mismatch": 1}
    )
    assert watch.quarantine == {0: BAD}
    # A ran on its loaded KV: only its last prompt token and the decode.
    assert str(consumer.final["A"].finish_reason) == "length"
    assert consumer.scheduled_tokens("A") == A_TOKENS
    # Two requests: R2 reads nothing from position 1 on.
    assert watch.hits["R2"] == (BAD * BS if arrival in ("at-verdict", "after") else 0)
    # Three: R3 hits R2's clean copies, blocks 0-5.
    assert watch.hits["R3"] == FULL_HIT
    assert consumer.checksums.stats.quarantined_blocks == LOADED_POSITIONS - BAD
    assert quarantine_lines(info_caplog) == [
        "KV checksums: quarantined 4 loaded blocks of request A (group 0 from "
        "block position 1): kept out of the prefix cache."
    ]


def test_fail_open_async_scheduler(model_dir: str) -> None:
    """R138 with the AsyncScheduler (its update_from_output caches blocks
    itself): as `test_fail_open_mismatch_contained[at-verdict]`."""
    watch = run_bad_load(model_dir, "fail-open", "at-verdict", async_scheduler=True)
    assert watch.hits == {"R2": BAD * BS, "R3": FULL_HIT}


def test_fail_open_hybrid_groups(model_dir: str) -> None:
    """R138 with a full-attention and a sliding-window group: a zeroed block
    at the sliding group's first loaded position (position 2, tokens 32-47)
    quarantines both groups from position 2, so no request hits A's blocks
    past token 32 in either group. Catches quarantining only the group the
    mismatch was reported in (A's group 0 blocks 2-4 stay hashed)."""
    watch = run_bad_load(
        model_dir,
        "fail-open",
        "after",
        fault=Fault("zero_block", 0, group=1),
        expected={0: 2, 1: 2},
        groups="both",
    )
    assert watch.quarantine == {0: 2, 1: 2}
    assert watch.hits["R2"] <= 2 * BS


def test_without_containment_the_bad_load_spreads(model_dir: str, monkeypatch) -> None:
    """The control: the same fail-open scenario with containment off
    (`KV_CHECKSUM_TEST_NO_CONTAINMENT=1`, checksums still on) lets R2 hit A's
    corrupted block: the content oracle sees the spread. Shows the oracles of
    the other tests can fail."""
    monkeypatch.setenv(wiring_containment.NO_CONTAINMENT_ENV, "1")
    producer, consumer = engines(model_dir, mode_side("fail-open"))
    assert not hasattr(consumer.scheduler, "kv_checksum_containment")
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, Fault("bit_flip", BAD))
    consumer.finish_load("A")
    watch.step()
    add_local(consumer, "R2")
    with pytest.raises(AssertionError, match="R2 read wrong KV at block positions"):
        watch.step()
    assert dict(consumer.checksums.stats.loads) == {"mismatch": 1}


def test_preempted_fail_open_request_recomputes_and_caches(model_dir: str) -> None:
    """R138: a quarantined fail-open request that vLLM preempts gives its
    blocks back; on resume it recomputes from its last clean cached block and
    those blocks are cached as usual (the quarantine ended with the free).
    Catches a quarantine kept past vLLM's free (the recomputed blocks never
    serve)."""
    producer, consumer = engines(model_dir, mode_side("fail-open"))
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, Fault("bit_flip", BAD))
    consumer.finish_load("A")
    watch.step()
    watch.start = {0: BAD}
    watch.step()
    request = consumer.scheduler.requests["A"]
    consumer.scheduler.running.remove(request)
    consumer.scheduler._preempt_request(request, 0.0)
    assert "A" not in consumer.scheduler.kv_checksum_containment
    watch.start = None  # A's blocks are now recomputed ones
    watch.run("A")
    add_local(consumer, "R2")
    watch.run("R2")
    assert watch.hits["R2"] == FULL_HIT


# --------------------------------------------------------------------------
# Fail-closed: nobody reads the blocks before recompute; "fail" evicts
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_fail_closed_recompute_contained(
    model_dir: str, info_caplog, arrival: str
) -> None:
    """R138, R95: fail-closed with "recompute", no other request reads the
    failed load's blocks before A recomputes them (hash invariant until vLLM
    frees them, content oracle on every hit); A recomputes its whole prompt,
    and the recomputed blocks serve later requests as usual (after: R2 hits
    A's recomputed blocks 0-5). Catches a quarantine kept past the free."""
    watch = run_bad_load(model_dir, "fail-closed-recompute", arrival)
    consumer = watch.consumer
    assert watch.quarantine == {0: BAD}
    assert str(consumer.final["A"].finish_reason) == "length"
    # A recomputes the prompt (during: from R2's copies of blocks 0-3).
    hit = 4 * BS if arrival == "during" else 0
    assert consumer.scheduled_tokens("A") == PROMPT_LEN + A_TOKENS - 1 - hit
    if arrival == "after":
        assert watch.hits["R2"] == FULL_HIT  # A's recomputed blocks
    assert watch.hits["R3"] == FULL_HIT
    assert consumer.checksums.stats.quarantined_blocks == LOADED_POSITIONS - BAD
    assert len(quarantine_lines(info_caplog)) == 1


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_fail_closed_fail_evicts(model_dir: str, arrival: str) -> None:
    """R138, R95: fail-closed with "fail", A ends with an error and none of its
    loaded blocks is left in the prefix cache (never cached, evicted should
    they be); no other request reads them (content oracle), and the others
    compute the prefix themselves."""
    watch = run_bad_load(model_dir, "fail-closed-fail", arrival)
    consumer = watch.consumer
    assert str(consumer.final["A"].finish_reason) == "error"
    assert consumer.scheduled_tokens("A") == 0
    # A failed and was freed in the verdict step: none of its blocks cached.
    assert watch.hashed_after_verdict == []
    if arrival != "before":
        # R2 computed everything itself: nothing of A's load was cached.
        assert watch.hits["R2"] == 0
    assert watch.hits["R3"] == FULL_HIT
    assert consumer.checksums.stats.quarantined_blocks == LOADED_POSITIONS - BAD


@pytest.mark.parametrize("mode", list(MODES))
def test_blocks_cached_before_the_verdict_are_evicted(
    model_dir: str, mode: str
) -> None:
    """R138: should vLLM cache a loaded request's blocks before the verdict
    (0.33.0 delays it until the request is promoted), the quarantined ones are
    evicted at the verdict in every mode, before any other request's lookup.
    Catches containment acting in one mode only, or only on blocks cached
    after the verdict."""
    producer, consumer = engines(model_dir, mode_side(mode))
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, Fault("bit_flip", BAD))
    request = consumer.scheduler.requests["A"]
    consumer.scheduler.kv_cache_manager.cache_blocks(request, 4 * BS)
    pool = consumer.scheduler.kv_cache_manager.block_pool
    loaded = per_group(consumer.loads["A"].block_ids)[0]
    assert all(pool.blocks[b].block_hash is not None for b in loaded[:4])
    consumer.finish_load("A")
    watch.step()
    assert all(pool.blocks[b].block_hash is None for b in loaded[BAD:4])
    add_local(consumer, "R2")
    watch.step()
    # fail-open and "fail": A's clean block 0 (cached early) only;
    # "recompute": A's recomputed blocks 0-3, cached in the same schedule().
    assert watch.hits["R2"] == (4 * BS if mode == "fail-closed-recompute" else BS)
    watch.run("R2")


# --------------------------------------------------------------------------
# Loads that are not contained
# --------------------------------------------------------------------------


def hits_after_load(
    model_dir: str, side: SideConfig, drop_checksums: bool = False
) -> tuple[SimEngine, int]:
    """R2's prefix-cache hit after A's intact load and A's end."""
    producer, consumer = engines(model_dir, side)
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, None, drop_checksums=drop_checksums)
    consumer.finish_load("A")
    watch.run("A")
    add_local(consumer, "R2")
    watch.run("R2")
    return consumer, watch.hits["R2"]


@pytest.mark.parametrize("mode", ["fail-open", "fail-closed-recompute"])
def test_clean_load_cached_as_without_checksums(
    model_dir: str, info_caplog, mode: str
) -> None:
    """R138: a verified load is cached exactly as without checksums: the next
    request with the prefix hits A's blocks 0-5 (0-4 loaded, 4-5 filled by A's
    decode) on a consumer with and without checksums alike; nothing is
    quarantined. Catches containment touching clean loads."""
    consumer, hit = hits_after_load(model_dir, mode_side(mode))
    _, hit_off = hits_after_load(model_dir, SideConfig(enabled=False))
    assert dict(consumer.checksums.stats.loads) == {"verified": 1}
    assert hit == hit_off == FULL_HIT
    assert consumer.checksums.stats.quarantined_blocks == 0
    assert not quarantine_lines(info_caplog)


def test_unverified_fail_open_load_cached_as_without_checksums(
    model_dir: str,
) -> None:
    """R138 item 3, R94: fail-open, a load that ends unverified (the producer's
    checksums dropped) is cached as vLLM caches it without checksums. Catches
    treating unverified fail-open loads as mismatches."""
    consumer, hit = hits_after_load(
        model_dir, mode_side("fail-open"), drop_checksums=True
    )
    assert dict(consumer.checksums.stats.loads) == {"unverified": 1}
    assert hit == FULL_HIT
    assert consumer.checksums.stats.quarantined_blocks == 0


@pytest.mark.parametrize("mode", ["fail-closed-recompute", "fail-closed-fail"])
def test_unverified_fail_closed_load_contained(model_dir: str, mode: str) -> None:
    """R138 item 3, R95: fail-closed, an unverified load is contained like a
    mismatch from its first loaded position: none of its blocks serves
    another request before A recomputes it (or at all, with "fail"): R2,
    arriving in the step after the verdict, computes the prefix itself or
    (recompute) hits A's recomputed blocks 0-3."""
    producer, consumer = engines(model_dir, mode_side(mode))
    watch = Watch(consumer, start={0: 0})
    start_load(consumer, producer, "A", PROMPT, None, drop_checksums=True)
    consumer.finish_load("A")
    watch.step()
    add_local(consumer, "R2")
    watch.run("A", "R2")
    assert dict(consumer.checksums.stats.loads) == {"unverified": 1}
    assert watch.hits["R2"] == (4 * BS if mode == "fail-closed-recompute" else 0)
    assert consumer.checksums.stats.quarantined_blocks == LOADED_POSITIONS


# --------------------------------------------------------------------------
# Wiring: pass-through when off, never an exception into vLLM
# --------------------------------------------------------------------------


def test_checksums_off_exact_pass_through(model_dir: str) -> None:
    """R138 with R1: checksums off, the KV cache coordinator keeps vLLM's own
    methods (no instance wrappers) and the scheduler gets no containment."""
    engine = SimEngine(model_dir, SideConfig(enabled=False), "plain")
    coordinator = engine.scheduler.kv_cache_manager.coordinator
    for name in ("cache_blocks", "free", "pop_blocks_for_free"):
        assert name not in vars(coordinator)
    assert "kv_checksum_containment" not in vars(engine.scheduler)


def test_containment_errors_never_reach_vllm(
    model_dir: str, vllm_caplog, monkeypatch
) -> None:
    """R138: an exception inside containment is logged and the engine goes on
    (A still runs fail-open). Catches an unguarded callback failing vLLM's
    update_from_output."""
    producer, consumer = engines(model_dir, mode_side("fail-open"))

    def boom(*args: Iterable[Any]) -> Any:
        raise RuntimeError("boom")

    containment = consumer.scheduler.kv_checksum_containment
    monkeypatch.setattr(containment, "on_failed_load", boom)
    start_load(consumer, producer, "A", PROMPT, Fault("bit_flip", BAD))
    consumer.finish_load("A")
    consumer.run("A")
    assert str(consumer.final["A"].finish_reason) == "length"
    assert any(
        "KV checksum containment failed for request A" in r.getMessage()
        for r in vllm_caplog.records
    )
    assert consumer.scheduler.kv_checksum_scheduler is not None


# --------------------------------------------------------------------------
# Two failed loads of one request
# --------------------------------------------------------------------------


@pytest.mark.parametrize("later_first", [True, False], ids=["later-first", "earlier"])
def test_second_failed_load_keeps_the_earlier_start(
    model_dir: str, later_first: bool
) -> None:
    """R138: a request whose loads fail twice (a P/D or host load, then a
    check of the same request, e.g. its prefix-cache hit) stays quarantined
    from the earlier of the two starts in each group, whichever is reported
    first. A's load is corrupted at `first`, reported by its verdict; a
    second failed load of A at `second` is handed to the scheduler's callback
    before vLLM caches A's blocks; A's blocks from position 1 on never hold a
    prefix-cache hash and R2, arriving then, gets block 0 only.

    Bugs caught: the second failed load replacing the request's quarantine
    start instead of keeping the earlier one (`earlier`: the start moves to
    3, A's corrupted block 1 is cached and R2 reads it), and the first
    report's start kept whatever comes after (`later-first`: blocks 1-2,
    between the two starts, are cached)."""
    first, second = (3, BAD) if later_first else (BAD, 3)
    producer, consumer = engines(model_dir, mode_side("fail-open"))
    watch = Watch(consumer)
    start_load(consumer, producer, "A", PROMPT, Fault("bit_flip", first))
    consumer.finish_load("A")
    watch.step()  # A's verdict: a mismatch at `first`
    containment = consumer.scheduler.kv_checksum_containment
    assert containment.start("A") == {0: first}
    blocks = consumer.recv_blocks("A")
    assert blocks is not None
    again = KVChecksumVerdict(KVChecksumStatus.MISMATCH, {0: [second]})
    consumer.checksums.on_failed_load("A", again, blocks)
    assert containment.start("A") == {0: BAD}
    watch.start = {0: BAD}
    add_local(consumer, "R2")
    watch.run("A", "R2")
    assert watch.hits["R2"] == BAD * BS
