# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba2 checksums through vLLM's real Scheduler and KVCacheManager (R67, R85).

A tiny Mamba2ForCausalLM is built per simulated TP rank with
`test_kv_checksum_mamba_models.build_rank` (vLLM's layers, specs with the
plugin's splits, `get_kv_cache_configs`, `allocate_kv_cache`,
`bind_kv_cache`); rank 0's KV cache config drives a real vLLM `Scheduler`
(the plugin's hooks installed, the carrier test connector of
`kv_checksum_pd`, prefix caching on, so vLLM puts the Mamba group in "align"
mode). With `SPEC` speculative tokens (an n-gram `SpeculativeConfig` on both
the model's and the scheduler's config) the Mamba group has two speculative
scratch blocks, which vLLM allocates after the running state.

The "forward" of a step writes a global (TP = 1) Mamba2 state through each
rank's bound views into the block NIXL would transfer (computed independently
from the KV cache manager's block list with vLLM's `clip_ssm_state_blocks`,
and from first principles: block `cdiv(tokens, block_size) - 1` of the
position-indexed list) and other random states into every other block of the
request, so a checksum of any other block gives another value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit import test_kv_checksum_mamba_models as models
from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    consumer_kv_transfer_params,
    make_kv_connector_output,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    producer_kv_transfer_params,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    on_verdicts,
    per_group,
    register_carrier_connector,
)
from tests.v1.kv_connector.unit.test_kv_checksum_mamba import (
    U64,
    GlobalState,
    reference_layer_checksum,
)
from tests.v1.kv_connector.unit.test_kv_checksum_mamba_models import (
    LAYERS,
    RankEngine,
    build_rank,
    layer_names,
    random_state,
    write_mamba2,
    write_state,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
)
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.utils.math_utils import cdiv

pytestmark = [pytest.mark.cpu, pytest.mark.kv_checksum_capability("hybrid")]

# The one-process gloo TP group the ranks are built in (a module fixture).
distributed = models.distributed

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
SPEC = 2  # speculative tokens: Mamba scratch blocks
N_GROUPS = 1  # Mamba2 groups: B and C replicated on every rank
PROMPT_LENGTHS = (5, 16, 17, 40)


def speculative_config(config: Any) -> Any:
    """`config` with an n-gram speculative config of `SPEC` tokens."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=SPEC,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=config.model_config,
        target_parallel_config=config.parallel_config,
    )
    return dataclasses.replace(config, speculative_config=spec)


@dataclasses.dataclass
class MambaSide:
    """A real vLLM scheduler over the KV cache config of simulated ranks."""

    scheduler: Any
    ranks: list[RankEngine]
    tp: int
    num_spec: int
    verdicts: list[tuple[str, KVChecksumVerdict]]
    finals: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def checksums(self) -> Any:
        return self.scheduler.kv_checksum_scheduler

    def block_ids(self, req_id: str) -> list[int]:
        """The request's Mamba group block ids (null blocks included)."""
        return per_group(self.scheduler.kv_cache_manager.get_block_ids(req_id))[0]

    def null_block(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.null_block.block_id)

    def write(self, block: int, states: list[GlobalState]) -> None:
        """Write a global state per layer into `block` on every rank."""
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(models, "BLOCK", block)
            for rank, engine in enumerate(self.ranks):
                for name, state in zip(layer_names("mamba2"), states):
                    write_state(engine, name, state, self.tp, rank, N_GROUPS)

    def forward(
        self, req_id: str, state_block: int, states: list[GlobalState], seed: int
    ) -> None:
        """`states` into `state_block`, other random states into every other
        (non-null) block of the request."""
        rng = np.random.default_rng(seed)
        for block in self.block_ids(req_id):
            if block not in (state_block, self.null_block()):
                self.write(block, [mamba2_state(rng, self.num_spec)] * LAYERS)
        self.write(state_block, states)

    def finish(self, output: Any, finished_recving: Iterable[str] = ()) -> None:
        finish_step(self, output, finished_recving)


def finish_step(side: Any, output: Any, finished_recving: Iterable[str] = ()) -> None:
    """The workers' checksum calls and `update_from_output` of a step of a
    side with simulated `ranks`, a real `scheduler` and `finals` (the
    requests' last outputs)."""
    records = []
    for engine in side.ranks:
        engine.worker.bind(getattr(output, "kv_checksum_scheduled", None))
        pending = engine.worker.post_forward(
            set(finished_recving), set(), None, output.finished_req_ids
        )
        if pending is not None:
            records.append(pending)
    kv_output = make_kv_connector_output(finished_recving=finished_recving)
    kv_output.kv_checksums = records or None  # type: ignore[attr-defined]
    model_output = make_model_runner_output(
        output, scheduler=side.scheduler, kv_connector_output=kv_output
    )
    outputs = side.scheduler.update_from_output(output, model_output)
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.finish_reason is not None:
                side.finals[out.request_id] = out


def build_side(
    model: str,
    tp: int,
    num_spec: int,
    name: str,
    group: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> MambaSide:
    """Ranks of a real Mamba2 model at `tp` and a real scheduler over them."""
    if num_spec:
        make = models.make_config
        monkeypatch.setattr(
            models, "make_config", lambda m, t: speculative_config(make(m, t))
        )
    ranks = [build_rank("mamba2", model, tp, r, group, monkeypatch) for r in range(tp)]
    if num_spec:
        monkeypatch.setattr(models, "make_config", make)
    kv_cache_config = ranks[0].kv_cache_config
    register_carrier_connector()
    config = make_vllm_config(
        model,
        block_size=BLOCK_SIZE,
        num_blocks=kv_cache_config.num_blocks,
        tp_size=tp,
        kv_connector=CARRIER_CONNECTOR_NAME,
        extra_config={
            "enable_kv_checksum": True,
            "kv_checksum_fail_closed": True,
            "test_engine_name": name,
        },
        max_model_len=MAX_MODEL_LEN,
    )
    if num_spec:
        config = speculative_config(config)
    scheduler = make_scheduler(config, kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert spec.mamba_cache_mode == "align"
    assert spec.num_speculative_blocks == num_spec
    side = MambaSide(scheduler, ranks, tp, num_spec, [])
    kcs = side.checksums
    assert kcs is not None and kcs.group_infos[0].is_mamba
    on_verdicts(kcs, lambda req_id, verdict: side.verdicts.append((req_id, verdict)))
    return side


def running_state_block(
    blocks: list[int], num_tokens: int, block_size: int, num_spec: int
) -> int:
    """The Mamba block NIXL transfers, computed twice: vLLM's
    `clip_ssm_state_blocks` on the block list and align mode's position
    `cdiv(n, bs) - 1`, followed only by the `num_spec` scratch blocks."""
    (clipped,) = clip_ssm_state_blocks(list(blocks), num_spec)
    index = cdiv(num_tokens, block_size) - 1
    assert blocks[index] == clipped
    assert len(blocks) - index - 1 == num_spec
    return clipped


def mamba2_state(rng: np.random.Generator, num_spec: int) -> GlobalState:
    """`random_state("mamba2")` with the conv state `num_spec` rows longer
    (vLLM's conv state holds kernel - 1 + speculative tokens)."""
    base = random_state(rng, "mamba2", N_GROUPS)
    length = base.conv[0].shape[1] + num_spec
    conv = [
        rng.integers(0, 1 << 16, size=(seg.shape[0], length), dtype=np.uint16)
        for seg in base.conv
    ]
    return GlobalState(conv, base.temporal)


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 250 + 3 for i in range(length)]


def global_states(seed: int, num_spec: int) -> list[GlobalState]:
    rng = np.random.default_rng(seed)
    return [mamba2_state(rng, num_spec) for _ in range(LAYERS)]


def reference(states: list[GlobalState]) -> int:
    return sum(reference_layer_checksum(n, states[n]) for n in range(LAYERS)) % (
        1 << 64
    )


def payload_value(side: MambaSide, params: dict[str, Any]) -> int:
    payload = KVChecksumPayload.from_base64(
        params[KV_TRANSFER_PARAMS_KEY], side.checksums.limits
    )
    (group,) = payload.groups
    assert group.group_id == 0
    return int(group.values.astype(U64)[0])


@dataclasses.dataclass
class Produced:
    """A finished producer request."""

    params: dict[str, Any]
    sent: KVChecksumBlocks
    state_block: int
    scheduled_blocks: list[int]
    # Tokens of the prompt hit in the prefix cache.
    cached_tokens: int


def produce(
    side: MambaSide, req_id: str, prompt: list[int], states: list[GlobalState]
) -> Produced:
    """Run a do_remote_decode request; its prompt ends in the first step."""
    side.scheduler.add_request(
        make_request(
            req_id,
            prompt,
            max_tokens=1,
            kv_transfer_params=producer_kv_transfer_params(),
            block_size=BLOCK_SIZE,
        )
    )
    output = side.scheduler.schedule()
    (scheduled_tokens,) = output.num_scheduled_tokens.values()
    assert side.scheduler.requests[req_id].num_computed_tokens == len(prompt)
    blocks = side.block_ids(req_id)
    state_block = running_state_block(blocks, len(prompt), BLOCK_SIZE, side.num_spec)
    side.forward(req_id, state_block, states, seed=len(prompt))
    scheduled = output.kv_checksum_scheduled
    assert scheduled is not None
    sent = scheduled.reqs_to_send[req_id]
    side.finish(output)
    final = side.finals[req_id]
    assert final.kv_transfer_params is not None
    return Produced(
        dict(final.kv_transfer_params),
        sent,
        state_block,
        blocks,
        len(prompt) - scheduled_tokens,
    )


@pytest.mark.parametrize("num_spec", [0, SPEC])
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_producer_registers_the_running_state_block_r67(
    distributed: Any,
    tmp_path: Any,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    length: int,
    num_spec: int,
) -> None:
    """R67, R68 through vLLM's Scheduler in align mode (prefix caching on):
    the step that finishes a do_remote_decode prompt registers, for the Mamba
    group, position 0 and exactly the block NIXL transfers
    (`clip_ssm_state_blocks` of the request's blocks, equal to the clipped
    `remote_block_ids` the connector hands over), never a trailing
    speculative scratch block, and the producer's payload is the independent
    reference checksum of the state written there. A second request
    extending the first prompt is checked the same way: from 17 tokens on it
    starts from a Mamba prefix-cache hit (vLLM reuses the cached state block
    and allocates the running state after it).

    Bugs caught: selecting the Mamba group by token range like attention
    (position != 0, or the prefill checkpoint block: prompts 17 and 40),
    taking the first real block (17, 40), "take the last block" with scratch
    blocks (every length with num_spec = 2)."""
    model = write_mamba2(str(tmp_path), N_GROUPS)
    side = build_side(model, 1, num_spec, "producer", distributed, monkeypatch)
    for req_id, prompt in (
        ("p", prompt_of(length)),
        ("hit", prompt_of(length) + prompt_of(length, offset=1)),
    ):
        states = global_states(len(prompt), num_spec)
        produced = produce(side, req_id, prompt, states)
        assert set(produced.sent.groups) == {0}
        position, ids = produced.sent.groups[0]
        assert position == 0
        assert ids.tolist() == [produced.state_block]
        scratch = produced.scheduled_blocks[len(produced.scheduled_blocks) - num_spec :]
        assert produced.state_block not in scratch
        if num_spec:
            assert len(scratch) == num_spec
        # The block NIXL transfers, from the ids the connector hands over.
        (remote,) = per_group(produced.params["remote_block_ids"])
        assert clip_ssm_state_blocks(remote, num_spec) == [produced.state_block]
        assert payload_value(side, produced.params) == reference(states)
        if req_id == "hit":
            # vLLM caches the Mamba state of the first request's full blocks
            # short of its last token: a hit from 17 tokens on.
            full = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
            assert produced.cached_tokens == full


def consume_load(
    consumer: MambaSide,
    req_id: str,
    prompt: list[int],
    params: dict[str, Any],
    states: list[GlobalState],
    flip: bool,
) -> tuple[KVChecksumBlocks, int, KVChecksumVerdict]:
    """Start the load, copy the state over (and flip a byte), finish it.

    Returns the registered load's blocks, the consumer's running-state block
    and the verdict.
    """
    remote = per_group(params["remote_block_ids"])
    consumer.scheduler.add_request(
        make_request(
            req_id,
            prompt,
            max_tokens=2,
            kv_transfer_params=consumer_kv_transfer_params(
                req_id,
                remote_block_ids=remote,
                **{KV_TRANSFER_PARAMS_KEY: params[KV_TRANSFER_PARAMS_KEY]},
            ),
            block_size=BLOCK_SIZE,
        )
    )
    output = consumer.scheduler.schedule()
    assert not output.num_scheduled_tokens  # waiting for the remote KV
    load = consumer.scheduler.connector.pending_loads[req_id]
    loaded_tokens = consumer.scheduler.requests[req_id].num_computed_tokens
    assert loaded_tokens == load.num_external_tokens == len(prompt) - 1
    blocks = per_group(load.block_ids)[0]
    state_block = running_state_block(
        blocks, loaded_tokens, BLOCK_SIZE, consumer.num_spec
    )
    scheduled = output.kv_checksum_scheduled
    assert scheduled is not None
    recv = scheduled.reqs_to_recv[req_id]
    # The transfer: the producer's state lands in the running-state block.
    consumer.forward(req_id, state_block, states, seed=len(prompt) + 1)
    if flip:
        # One byte of the last rank's first layer conv state (x channels).
        conv = consumer.ranks[-1].layers[layer_names("mamba2")[0]].kv_cache[0]
        conv[state_block].view(torch.uint8).view(-1)[1] ^= 0x10
    consumer.finish(output)
    assert not consumer.verdicts
    output = consumer.scheduler.schedule()
    consumer.finish(output, finished_recving={req_id})
    ((verified_id, verdict),) = consumer.verdicts
    assert verified_id == req_id
    return recv, state_block, verdict


@pytest.mark.parametrize("flip", [False, True], ids=["copied", "flipped"])
@pytest.mark.parametrize("num_spec", [0, SPEC])
@pytest.mark.parametrize(
    "tp_pair", [(1, 1), (2, 1), (1, 2)], ids=["tp1-tp1", "tp2-tp1", "tp1-tp2"]
)
def test_consumer_load_round_trip_r67_r85(
    distributed: Any,
    tmp_path: Any,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    tp_pair: tuple[int, int],
    num_spec: int,
    flip: bool,
) -> None:
    """R67, R70, R85 end to end through two real schedulers: the producer's
    workers checksum the running-state block of its real bound views, the
    payload travels in kv_transfer_params, the consumer's do_remote_prefill
    load registers, for the Mamba group, position 0 and its running-state
    block (not a scratch block), and its workers' reports verify when the
    same state was copied there (producer TP -> consumer TP: 1 -> 1, 2 -> 1,
    1 -> 2) and mismatch at group 0, position 0 when one byte differs.

    Bugs caught: the consumer registering a scratch block ("take the last
    block" with num_spec = 2: verified loads would mismatch, the state is
    not there), or a token-range block (position != 0); a producer and
    consumer numbering Mamba2 rows per rank (TP 2 -> 1 mismatch); a
    corrupted state not compared (the flipped load verifying)."""
    model = write_mamba2(str(tmp_path), N_GROUPS)
    p_tp, c_tp = tp_pair
    producer = build_side(model, p_tp, num_spec, "producer", distributed, monkeypatch)
    consumer = build_side(model, c_tp, num_spec, "consumer", distributed, monkeypatch)
    prompt = prompt_of(40)
    states = global_states(40, num_spec)
    # vLLM's NIXL producer drops the prompt's last token for Mamba (its
    # prefill backoff), so both sides hold h(N - 1).
    produced = produce(producer, "r", prompt[:-1], states)
    assert payload_value(producer, produced.params) == reference(states)

    recv, state_block, verdict = consume_load(
        consumer, "r", prompt, produced.params, states, flip
    )
    assert set(recv.groups) == {0}
    position, ids = recv.groups[0]
    assert position == 0 and ids.tolist() == [state_block]
    if flip:
        assert verdict.status == KVChecksumStatus.MISMATCH
        assert verdict.mismatches == {0: [0]}
    else:
        assert verdict.status == KVChecksumStatus.VERIFIED, verdict


@pytest.mark.parametrize("tp_pair", [(1, 1), (2, 1)], ids=["tp1-tp1", "tp2-tp1"])
def test_state_after_another_token_count_mismatches_r67(
    distributed: Any,
    tmp_path: Any,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    tp_pair: tuple[int, int],
) -> None:
    """R67: both sides must hold the state after the same tokens. A producer
    that kept its last prompt token (no prefill backoff: vLLM's NIXL producer
    skips it for a request that skips reading the prefix cache) sends h(N)
    where the consumer, loading N - 1 tokens, needs h(N - 1); its bytes arrive
    intact, yet the load is wrong and must mismatch at the Mamba group.

    Bug this fails: comparing Mamba state values without the two sides' token
    counts (the H200 hybrid driver's first runs verified such loads, and every
    output differed from a single engine)."""
    model = write_mamba2(str(tmp_path), N_GROUPS)
    p_tp, c_tp = tp_pair
    producer = build_side(model, p_tp, 0, "producer", distributed, monkeypatch)
    consumer = build_side(model, c_tp, 0, "consumer", distributed, monkeypatch)
    prompt = prompt_of(40)
    states = global_states(40, 0)
    produced = produce(producer, "r", prompt, states)  # h(40), not h(39)
    _, _, verdict = consume_load(consumer, "r", prompt, produced.params, states, False)
    assert verdict.status == KVChecksumStatus.MISMATCH, verdict
    assert verdict.mismatches == {0: [0]}
