# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A hybrid attention + Mamba2 model through vLLM's real Scheduler (R64-R67, R85).

The model is a tiny NemotronHForCausalLM with hybrid_override_pattern "M*M-"
(Mamba2 layer 0, attention layer 1, Mamba2 layer 2, MLP layer 3), the model
the next GPU P/D proof uses (NIXL cannot hand over a pure Mamba2 model). It is
built per simulated TP rank in the one-process gloo TP group of
`test_kv_checksum_mamba_models` (real MambaMixer2 layers sharding themselves,
their `get_kv_cache_spec` through the plugin's hook, so every MambaSpec carries
`state_splits`), and real vLLM `Attention` layers: the platform of these tests
(`UnspecifiedPlatform`) selects no attention backend, so the `hybrid_platform`
fixture makes it answer what an H200 answers, FlashAttention's backend class
(only its class methods run: kernel block sizes and spec customisation), and
`support_hybrid_kv_cache()` True (else vLLM turns off the hybrid KV cache
manager and cannot group the two kinds of layers). Everything after that is
vLLM's own path: `update_block_size_for_backend` (the hybrid page alignment:
the attention block size grows, in FlashAttention's multiples of 16, until an
attention page is at least a Mamba page, and the Mamba page is padded to equal
it: 32 tokens here), `get_kv_cache_spec`, pickling as to the engine core,
`get_global_kv_cache_groups` and `get_kv_cache_configs` (two Mamba groups and
one full-attention group over one shared block pool and backing buffer),
`allocate_kv_cache`, `bind_kv_cache_to_layers`, the package's
`create_kv_checksum_worker`, `resolve_kv_cache_block_sizes` and a real
`Scheduler` with the plugin's hooks and a carrier test connector.

The connector of both sides is the carrier test connector with NIXL 0.33.0's
prefill backoff for Mamba models: a producer request drops its last prompt
token when it arrives (`_truncate_request_for_prefill`) and a consumer loads
all but the last prompt token, so both hold the KV of N - 1 tokens and the
Mamba state after them.

The "forward" writes, per rank, known attention KV (a fixed function of
token, position, layer and global head) into the request's attention blocks,
a known global (TP = 1) Mamba2 state through each rank's bound views into the
running-state block of each Mamba group (found independently: vLLM's
`clip_ssm_state_blocks` and align mode's position `cdiv(tokens, bs) - 1`), and
other random states into the group's other blocks; the whole backing buffer
starts as random bytes, different per side, so slots past the last token and
unused blocks hold garbage. Expected checksums come from the independent
references: `kv_checksum_reference.reference_block_checksums` for attention
and `test_kv_checksum_mamba.reference_layer_checksum` for Mamba.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit import test_kv_checksum_mamba_models as models
from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    consumer_kv_transfer_params,
    fill_random_bytes,
    make_request,
    make_vllm_config,
    producer_kv_transfer_params,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    KVChecksumCarrierTestConnector,
    kv_bytes,
    on_verdicts,
    per_group,
    register_carrier_connector,
)
from tests.v1.kv_connector.unit.kv_checksum_reference import (
    reference_block_checksums,
)
from tests.v1.kv_connector.unit.test_kv_checksum_mamba import (
    U64,
    GlobalState,
    reference_layer_checksum,
)
from tests.v1.kv_connector.unit.test_kv_checksum_mamba_scheduler import (
    SPEC,
    finish_step,
    prompt_of,
    running_state_block,
    speculative_config,
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
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.utils.math_utils import cdiv

pytestmark = [pytest.mark.cpu, pytest.mark.kv_checksum_capability("hybrid")]

# The one-process gloo TP group the ranks are built in (a module fixture).
distributed = models.distributed

PATTERN = "M*M-"  # Mamba2, attention, Mamba2, MLP
MAMBA_LAYERS = (0, 2)
ATTENTION_LAYER = 1
HIDDEN = 64
ATTENTION_HEADS, KV_HEADS, ATTENTION_HEAD_DIM = 4, 2, 32
MAMBA_HEADS, MAMBA_HEAD_DIM, STATE, CONV_KERNEL = 4, 32, 8, 4
INTERMEDIATE = MAMBA_HEADS * MAMBA_HEAD_DIM
# K and V of one head and token: the attention cell of vLLM's [B, H, N, C] view.
CELL = 2 * ATTENTION_HEAD_DIM * torch.bfloat16.itemsize
MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
# N - 1 tokens move (the backoff): inside the first aligned block (5, 17),
# exactly one block (33), crossing into the second (40) and the third (70).
PROMPT_LENGTHS = (5, 17, 33, 40, 70)
FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
HYBRID_CONNECTOR_NAME = "KVChecksumHybridCarrierTestConnector"


def mamba_name(layer: int) -> str:
    return f"model.layers.{layer}.mixer"


ATTENTION_NAME = f"model.layers.{ATTENTION_LAYER}.mixer.attn"


# --------------------------------------------------------------------------
# The connector: the carrier test connector with NIXL's prefill backoff
# --------------------------------------------------------------------------


class KVChecksumHybridCarrierTestConnector(KVChecksumCarrierTestConnector):
    """The carrier test connector truncating producer prompts as NIXL 0.33.0
    does for models with Mamba layers (`_truncate_request_for_prefill`, a
    backoff of one token): the producer computes N - 1 tokens, the decoder
    loads them (the base connector loads all but the last prompt token) and
    recomputes the last one."""

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_decode")
            and not params.get("_p_side_truncated")
            and request.num_prompt_tokens > 1
        ):
            del request.prompt_token_ids[-1:]
            del request._all_token_ids[-1:]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1
            params["_p_side_truncated"] = True


def register_hybrid_connector() -> None:
    register_carrier_connector()
    if HYBRID_CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            HYBRID_CONNECTOR_NAME, __name__, "KVChecksumHybridCarrierTestConnector"
        )


# --------------------------------------------------------------------------
# The model and one simulated rank
# --------------------------------------------------------------------------


@pytest.fixture
def hybrid_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test platform answering as an H200 would for attention layers.

    `UnspecifiedPlatform` names no attention backend (vLLM's Attention layer
    raises "Invalid attention backend") and says the hybrid KV cache manager
    is unsupported; FlashAttention's backend class imports on CPU and only its
    class methods run. The backend selection cache is cleared on both ends.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: FLASH_ATTN,
        raising=False,
    )
    monkeypatch.setattr(
        current_platform, "support_hybrid_kv_cache", lambda: True, raising=False
    )
    monkeypatch.setattr(
        current_platform, "current_device", lambda: torch.device("cpu"), raising=False
    )
    try:
        yield
    finally:
        selector._cached_get_attn_backend.cache_clear()


def write_nemotron_h(folder: str, n_groups: int) -> str:
    """A tiny NemotronH config (Mamba SSM state float32, NemotronH's default)."""
    import transformers

    transformers.NemotronHConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        hybrid_override_pattern=PATTERN,
        num_attention_heads=ATTENTION_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=ATTENTION_HEAD_DIM,
        intermediate_size=128,
        ssm_state_size=STATE,
        mamba_num_heads=MAMBA_HEADS,
        mamba_head_dim=MAMBA_HEAD_DIM,
        n_groups=n_groups,
        conv_kernel=CONV_KERNEL,
        max_position_embeddings=512,
    ).save_pretrained(folder)
    return folder


@dataclasses.dataclass
class HybridRank:
    """One simulated rank: bound layers, caches, configs and checksum worker."""

    config: Any
    layers: dict[str, Any]
    caches: dict[str, torch.Tensor]
    kv_cache_config: Any
    worker: Any


def build_rank(
    model: str, tp: int, rank: int, group: Any, seed: int, num_spec: int
) -> HybridRank:
    """vLLM's model, block alignment, specs, KV cache config and caches for
    (TP, rank), as the executor and the engine core build them; with
    `num_spec` n-gram speculative tokens."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import register_plugin
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
        create_kv_checksum_worker,
    )
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
    from vllm.platforms import current_platform
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers

    register_plugin()
    config = models.make_config(model, tp)
    if num_spec:
        assert num_spec == SPEC
        config = speculative_config(config)
    # Layers read the TP size when built and when binding their states.
    group.world_size, group.rank_in_group = tp, rank
    try:
        with set_current_vllm_config(config):
            NemotronHForCausalLM(vllm_config=config, prefix="")
            # The executor's step after load_model: hybrid page alignment.
            current_platform.update_block_size_for_backend(config)
            specs = pickle.loads(pickle.dumps(get_kv_cache_spec(config)))
            groups = get_global_kv_cache_groups(config, [specs])
            page = max(spec.page_size_bytes for spec in specs.values())
            (kv_cache_config,) = get_kv_cache_configs(
                config, [specs], [NUM_BLOCKS * len(specs) * page], groups
            )
            kv_cache_config.kv_cache_layout = config.cache_config.kv_cache_layout
            kv_cache_config = pickle.loads(pickle.dumps(kv_cache_config))
            caches = allocate_kv_cache(
                kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC
            )
            # Garbage everywhere a test does not write (one backing buffer).
            fill_random_bytes(next(iter(caches.values())), seed)
            layers = dict(config.compilation_config.static_forward_context)
            bind_kv_cache_to_layers(caches, layers)
            worker = create_kv_checksum_worker(
                config, kv_cache_config, caches, torch.device("cpu"), rank, 0
            )
    finally:
        group.world_size, group.rank_in_group = 1, 0
    assert worker is not None
    return HybridRank(config, layers, caches, kv_cache_config, worker)


# --------------------------------------------------------------------------
# Truth: attention KV and global Mamba2 states
# --------------------------------------------------------------------------


def attention_kv(tokens: list[int]) -> np.ndarray:
    """The global attention KV of `tokens` from position 0, uint8
    [1 layer, tokens, KV heads, CELL]: a fixed function of (token, position,
    layer, global head), so a prefix-cached block holds what a recomputed one
    would."""
    ids, positions = np.asarray(tokens), np.arange(len(tokens))
    heads = [
        kv_bytes(ids, positions, ATTENTION_LAYER, head, CELL)
        for head in range(KV_HEADS)
    ]
    return np.stack(heads, axis=1)[None]


def mamba_state(rng: np.random.Generator, n_groups: int, num_spec: int) -> GlobalState:
    """A global Mamba2 state: conv rows x, B, C (bf16 bits; kernel - 1 +
    speculative tokens long, as vLLM sizes them) and heads (f32 bits)."""
    bc = n_groups * STATE
    length = CONV_KERNEL - 1 + num_spec
    conv = [
        rng.integers(0, 1 << 16, size=(n, length), dtype=np.uint16)
        for n in (INTERMEDIATE, bc, bc)
    ]
    temporal = rng.integers(
        0, 1 << 32, size=(MAMBA_HEADS, MAMBA_HEAD_DIM, STATE), dtype=np.uint32
    )
    return GlobalState(conv, temporal)


def mamba_states(seed: int, n_groups: int, num_spec: int) -> dict[int, GlobalState]:
    """One global state per Mamba layer number."""
    rng = np.random.default_rng(seed)
    return {layer: mamba_state(rng, n_groups, num_spec) for layer in MAMBA_LAYERS}


def write_mamba(
    engine: HybridRank,
    layer: int,
    block: int,
    state: GlobalState,
    tp: int,
    rank: int,
    n_groups: int,
) -> None:
    """Shard the global state as vLLM does and write it through the layer's
    bound views: conv x and the heads split, B and C whole on every rank with
    one group (split with two)."""
    first, b, c = state.conv
    if n_groups == 1:
        parts = [models.shard(first, tp, rank), b, c]
    else:
        parts = [models.shard(segment, tp, rank) for segment in state.conv]
    conv = np.concatenate(parts)  # [channels, kernel - 1]
    conv_view, ssm_view = engine.layers[mamba_name(layer)].kv_cache[:2]
    target = conv_view[block].view(torch.int16)
    local = torch.from_numpy(conv.view(np.int16))
    # vLLM's default (SD) conv layout is (state_len, channels).
    target.copy_(local.T if target.shape[0] != conv.shape[0] else local)
    temporal = models.shard(state.temporal, tp, rank)
    ssm_view[block].view(torch.int32).copy_(torch.from_numpy(temporal.view(np.int32)))


def reference_attention(kv: np.ndarray, chunk: int) -> np.ndarray:
    """R17-R20 of the attention layer, one value per `chunk` tokens."""
    return reference_block_checksums(
        kv, chunk, layer_numbers=[ATTENTION_LAYER], head_numbers=range(KV_HEADS)
    )


def reference_mamba(layer: int, state: GlobalState) -> int:
    """R21/R39 of one Mamba layer (its own group), mod 2^64."""
    return reference_layer_checksum(layer, state) % (1 << 64)


def expected_chunk_tokens(block_size: int) -> int:
    """R135 stated independently: min(bs, 16) when it tiles, else gcd(bs, 16)."""
    return block_size if block_size <= 16 else math.gcd(block_size, 16)


# --------------------------------------------------------------------------
# One side: ranks and a real scheduler
# --------------------------------------------------------------------------


@dataclasses.dataclass
class HybridSide:
    """A real vLLM scheduler over the KV cache config of simulated ranks."""

    scheduler: Any
    ranks: list[HybridRank]
    tp: int
    n_groups: int
    num_spec: int
    block_size: int
    attention_group: int
    # Mamba layer number -> its KV cache group
    mamba_groups: dict[int, int]
    verdicts: list[tuple[str, KVChecksumVerdict]]
    finals: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def checksums(self) -> Any:
        return self.scheduler.kv_checksum_scheduler

    @property
    def all_groups(self) -> list[int]:
        return sorted([self.attention_group, *self.mamba_groups.values()])

    def block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block ids per group (null blocks included)."""
        return per_group(self.scheduler.kv_cache_manager.get_block_ids(req_id))

    def null_block(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.null_block.block_id)

    def heads_of(self, rank: int) -> list[int]:
        per_rank = max(1, KV_HEADS // self.tp)
        return list(range(rank * per_rank, (rank + 1) * per_rank))

    def write_attention(
        self, blocks: list[int], kv: np.ndarray, start: int, end: int
    ) -> None:
        """The KV of tokens [start, end) into their blocks on every rank."""
        bs = self.block_size
        for rank, engine in enumerate(self.ranks):
            cache = engine.caches[ATTENTION_NAME].view(torch.uint8)
            assert cache.shape[2] == bs  # no kernel-block split on this path
            heads = self.heads_of(rank)
            for t in range(start, end):
                data = torch.from_numpy(np.ascontiguousarray(kv[0, t, heads]))
                cache[blocks[t // bs], :, t % bs] = data

    def write_states(self, layer: int, block: int, state: GlobalState) -> None:
        for rank, engine in enumerate(self.ranks):
            write_mamba(engine, layer, block, state, self.tp, rank, self.n_groups)

    def forward_mamba(
        self,
        blocks: list[list[int]],
        num_tokens: int,
        states: dict[int, GlobalState],
        seed: int,
    ) -> dict[int, int]:
        """`states` into each Mamba group's running-state block, other random
        states into the group's other (non-null) blocks; returns the
        running-state block per Mamba layer."""
        rng = np.random.default_rng(seed)
        state_blocks = {}
        for layer, group in self.mamba_groups.items():
            state_block = running_state_block(
                blocks[group], num_tokens, self.block_size, self.num_spec
            )
            for block in blocks[group]:
                if block not in (state_block, self.null_block()):
                    other = mamba_state(rng, self.n_groups, self.num_spec)
                    self.write_states(layer, block, other)
            self.write_states(layer, state_block, states[layer])
            state_blocks[layer] = state_block
        return state_blocks

    def finish(self, output: Any, finished_recving: Iterable[str] = ()) -> None:
        finish_step(self, output, finished_recving)


def build_side(
    model: str,
    tp: int,
    n_groups: int,
    name: str,
    group: Any,
    monkeypatch: pytest.MonkeyPatch,
    num_spec: int = 0,
) -> HybridSide:
    """Ranks of the hybrid model at `tp` and a real scheduler over rank 0's
    KV cache config, with block sizes resolved as the engine core does."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    seed = sum(map(ord, name))
    ranks = [build_rank(model, tp, r, group, seed + r, num_spec) for r in range(tp)]
    kv_cache_config = ranks[0].kv_cache_config
    cache = ranks[0].config.cache_config
    register_hybrid_connector()
    config = make_vllm_config(
        model,
        block_size=cache.block_size,
        num_blocks=kv_cache_config.num_blocks,
        tp_size=tp,
        kv_connector=HYBRID_CONNECTOR_NAME,
        extra_config={
            "enable_kv_checksum": True,
            "kv_checksum_fail_closed": True,
            "test_engine_name": name,
        },
        max_model_len=MAX_MODEL_LEN,
    )
    if num_spec:
        config = speculative_config(config)
    config.cache_config.mamba_block_size = cache.mamba_block_size
    config.cache_config.mamba_page_size_padded = cache.mamba_page_size_padded
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, config
    )
    kv_cache_config.hash_block_size = hash_block_size
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=False,
    )
    attention = [
        g
        for g, spec in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(spec.kv_cache_spec, FullAttentionSpec)
    ]
    mamba = {
        int(spec.layer_names[0].split(".")[2]): g
        for g, spec in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(spec.kv_cache_spec, MambaSpec)
    }
    (attention_group,) = attention
    side = HybridSide(
        scheduler,
        ranks,
        tp,
        n_groups,
        num_spec,
        cache.block_size,
        attention_group,
        mamba,
        [],
    )
    kcs = side.checksums
    assert kcs is not None
    on_verdicts(kcs, lambda req_id, verdict: side.verdicts.append((req_id, verdict)))
    return side


# --------------------------------------------------------------------------
# Producer and consumer requests
# --------------------------------------------------------------------------


def payload_of(side: HybridSide, params: dict[str, Any]) -> KVChecksumPayload:
    return KVChecksumPayload.from_base64(
        params[KV_TRANSFER_PARAMS_KEY], side.checksums.limits
    )


@dataclasses.dataclass
class Produced:
    """A finished producer request."""

    params: dict[str, Any]
    sent: KVChecksumBlocks
    blocks: list[list[int]]
    state_blocks: dict[int, int]
    # Tokens the producer computed (the prompt less the backoff) and of those
    # the ones hit in the prefix cache.
    num_tokens: int
    cached_tokens: int


def produce(
    side: HybridSide,
    req_id: str,
    prompt: list[int],
    states: dict[int, GlobalState],
) -> Produced:
    """Run a do_remote_decode request to its end.

    Each step's "forward" writes the attention KV of the scheduled tokens and
    a Mamba state into the running-state blocks: random ones after a prefill
    chunk (align mode ends chunks on block boundaries), `states` after the
    step that finishes the (truncated) prompt.
    """
    side.scheduler.add_request(
        make_request(
            req_id,
            prompt,
            max_tokens=1,
            kv_transfer_params=producer_kv_transfer_params(),
            block_size=side.scheduler.hash_block_size,
        )
    )
    request = side.scheduler.requests[req_id]
    num_tokens = len(prompt) - 1  # NIXL's backoff for Mamba
    assert request.num_prompt_tokens == num_tokens
    kv = attention_kv(prompt)
    cached_tokens = None
    for step in range(MAX_MODEL_LEN):
        output = side.scheduler.schedule()
        scheduled = output.num_scheduled_tokens[req_id]
        end = request.num_computed_tokens
        if cached_tokens is None:
            cached_tokens = end - scheduled
        blocks = side.block_ids(req_id)
        side.write_attention(blocks[side.attention_group], kv, end - scheduled, end)
        if end < num_tokens:
            rng = np.random.default_rng(1000 + step)
            chunk_states = {
                layer: mamba_state(rng, side.n_groups, side.num_spec)
                for layer in MAMBA_LAYERS
            }
            side.forward_mamba(blocks, end, chunk_states, seed=step)
            side.finish(output)
            continue
        assert end == num_tokens
        state_blocks = side.forward_mamba(blocks, end, states, seed=len(prompt))
        assert output.kv_checksum_scheduled is not None
        sent = output.kv_checksum_scheduled.reqs_to_send[req_id]
        side.finish(output)
        break
    final = side.finals[req_id]
    assert final.kv_transfer_params is not None
    assert cached_tokens is not None
    return Produced(
        dict(final.kv_transfer_params),
        sent,
        blocks,
        state_blocks,
        num_tokens,
        cached_tokens,
    )


def check_payload(
    side: HybridSide,
    produced: Produced,
    prompt: list[int],
    states: dict[int, GlobalState],
) -> None:
    """The payload holds every group, each equal to the independent reference:
    attention per chunk of the aligned block (and per block, R22), Mamba one
    value per layer."""
    payload = payload_of(side, produced.params)
    assert payload.num_tokens == produced.num_tokens
    groups = {group.group_id: group for group in payload.groups}
    assert sorted(groups) == side.all_groups
    attention = groups[side.attention_group]
    chunk = expected_chunk_tokens(side.block_size)
    assert attention.chunk_tokens == chunk and attention.start == 0
    kv = attention_kv(prompt[: produced.num_tokens])
    values = np.asarray(attention.values, dtype=U64)
    assert values.tolist() == reference_attention(kv, chunk).tolist()
    # Consecutive chunks add up to the block checksum (R22).
    per_block = np.zeros(cdiv(values.size, side.block_size // chunk), dtype=U64)
    with np.errstate(over="ignore"):
        np.add.at(
            per_block, np.arange(values.size) // (side.block_size // chunk), values
        )
    assert per_block.tolist() == reference_attention(kv, side.block_size).tolist()
    for layer, group_id in side.mamba_groups.items():
        group = groups[group_id]
        assert group.start == 0 and group.chunk_tokens == 1
        (value,) = np.asarray(group.values, dtype=U64).tolist()
        assert value == reference_mamba(layer, states[layer])


def consume_load(
    consumer: HybridSide,
    req_id: str,
    prompt: list[int],
    params: dict[str, Any],
    states: dict[int, GlobalState],
    fault: str,
) -> tuple[KVChecksumBlocks, list[list[int]], int, KVChecksumVerdict]:
    """Start the load, copy the truth over (and corrupt one byte), finish it.

    Returns the registered load's blocks, the consumer's blocks per group,
    the loaded tokens and the verdict.
    """
    consumer.scheduler.add_request(
        make_request(
            req_id,
            prompt,
            max_tokens=2,
            kv_transfer_params=consumer_kv_transfer_params(
                req_id,
                remote_block_ids=per_group(params["remote_block_ids"]),
                **{KV_TRANSFER_PARAMS_KEY: params[KV_TRANSFER_PARAMS_KEY]},
            ),
            block_size=consumer.scheduler.hash_block_size,
        )
    )
    output = consumer.scheduler.schedule()
    assert not output.num_scheduled_tokens  # waiting for the remote KV
    load = consumer.scheduler.connector.pending_loads[req_id]
    loaded = consumer.scheduler.requests[req_id].num_computed_tokens
    assert loaded == load.num_external_tokens == len(prompt) - 1
    blocks = per_group(load.block_ids)
    assert output.kv_checksum_scheduled is not None
    recv = output.kv_checksum_scheduled.reqs_to_recv[req_id]
    # The transfer: the producer's KV and states land in the loaded blocks.
    attention_blocks = blocks[consumer.attention_group]
    consumer.write_attention(attention_blocks, attention_kv(prompt), 0, loaded)
    state_blocks = consumer.forward_mamba(blocks, loaded, states, seed=len(prompt) + 1)
    last, bs = consumer.ranks[-1], consumer.block_size
    if fault == "attention":
        # One byte of the last loaded token (the last rank's first head).
        t = loaded - 1
        cache = last.caches[ATTENTION_NAME].view(torch.uint8)
        cache[attention_blocks[t // bs], 0, t % bs, 3] ^= 0x10
    elif fault == "mamba_conv":
        # One bit of the last rank's layer 0 conv state, its first B channel
        # (a replica on every rank with one group at TP 2, R40); vLLM's SD
        # conv layout is (state_len, channels).
        conv = last.layers[mamba_name(0)].kv_cache[0][state_blocks[0]]
        assert conv.shape[0] == CONV_KERNEL - 1 + consumer.num_spec
        conv.view(torch.int16)[0, INTERMEDIATE // consumer.tp] ^= 1 << 9
    elif fault == "mamba_ssm":
        # One byte of the last rank's layer 2 SSM state (its last head).
        ssm = last.layers[mamba_name(2)].kv_cache[1]
        ssm[state_blocks[2]].view(torch.uint8).view(-1)[-2] ^= 0x10
    else:
        assert fault == "none"
    consumer.finish(output)
    assert not consumer.verdicts
    output = consumer.scheduler.schedule()
    consumer.finish(output, finished_recving={req_id})
    ((verified_id, verdict),) = consumer.verdicts
    assert verified_id == req_id
    return recv, blocks, loaded, verdict


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "n_groups", "num_spec"), [(1, 1, 0), (2, 1, 0), (2, 2, 0), (1, 1, SPEC)]
)
def test_hybrid_kv_cache_config_has_both_kinds_r36_r44(
    distributed: Any,
    tmp_path: Any,
    hybrid_platform: None,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    tp: int,
    n_groups: int,
    num_spec: int,
) -> None:
    """R36, R38-R40, R44, R67 set-up on vLLM's own hybrid planning: the KV
    cache config of "M*M-" has a full-attention group (layer 1) and one Mamba
    group per Mamba layer (0, 2) in one block pool; vLLM aligned the block
    size (> 16, a multiple of FlashAttention's 16) so the attention page
    equals the padded Mamba page; every Mamba group spec still carries the
    plugin's `state_splits` (B/C replicated with one group at TP 2, split with
    two); the scheduler marks the Mamba groups Mamba (one state, position 0)
    and TP-comparable and the attention group not; no worker skips a group.

    Bugs caught: splits lost on the way from the layer through hybrid
    grouping to the group spec (the scheduler would mark the Mamba groups
    incomparable across TP, R85); the scheduler treating every group of a
    model with a Mamba group as Mamba, or the reverse; a worker skipping the
    attention group of a hybrid model (e.g. treating its Mamba pages' padding
    as a mixed-spec group, R34 c)."""
    from vllm.distributed.kv_transfer.kv_checksum.hybrid.splits import (
        state_splits_of,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model = write_nemotron_h(str(tmp_path), n_groups)
    side = build_side(
        model, tp, n_groups, "producer", distributed, monkeypatch, num_spec
    )
    for engine in side.ranks:
        kv_cache_config = engine.kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
        assert kinds == ["FullAttentionSpec", "MambaSpec", "MambaSpec"]
        attention = groups[side.attention_group]
        assert attention.layer_names == [ATTENTION_NAME]
        assert isinstance(attention.kv_cache_spec, FullAttentionSpec)
        assert attention.kv_cache_spec.num_kv_heads == KV_HEADS // tp
        bs = attention.kv_cache_spec.block_size
        assert bs == side.block_size and bs > 16 and bs % 16 == 0
        for layer, group_id in side.mamba_groups.items():
            spec = groups[group_id].kv_cache_spec
            assert groups[group_id].layer_names == [mamba_name(layer)]
            assert isinstance(spec, MambaSpec)
            local_bc = max(n_groups, tp) * STATE // tp
            assert spec.mamba_cache_mode == "align" and spec.block_size == bs
            assert spec.num_speculative_blocks == num_spec
            channels = INTERMEDIATE // tp + 2 * local_bc
            assert spec.shapes[0] == (CONV_KERNEL - 1 + num_spec, channels)
            assert spec.page_size_bytes == attention.kv_cache_spec.page_size_bytes
            assert spec.dtypes[1] == torch.float32  # NemotronH's SSM cache dtype
            splits = state_splits_of(spec)
            assert splits is not None
            conv_segments = splits[0].segments
            replicas = tp if n_groups == 1 else 1
            assert conv_segments == (
                (INTERMEDIATE // tp, 1),
                (local_bc, replicas),
                (local_bc, replicas),
            )
            assert splits[1].segments == ((MAMBA_HEADS // tp, 1),)
        assert sorted(kv_cache_config.transfer_group_ids) == side.all_groups
        assert engine.worker.skipped_groups == ()
        assert sorted(engine.worker.groups) == side.all_groups
    infos = side.checksums.group_infos
    assert sorted(infos) == side.all_groups
    assert not infos[side.attention_group].is_mamba
    assert infos[side.attention_group].block_size == side.block_size
    for group_id in side.mamba_groups.values():
        assert infos[group_id].is_mamba and infos[group_id].tp_comparable


@pytest.mark.parametrize("num_spec", [0, SPEC])
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_producer_registers_attention_and_state_blocks_r64_r67(
    distributed: Any,
    tmp_path: Any,
    hybrid_platform: None,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    length: int,
    num_spec: int,
) -> None:
    """R64, R67, R68 through vLLM's Scheduler on a hybrid model: the step
    that finishes a do_remote_decode prompt (N - 1 tokens after NIXL's
    backoff) registers, for the attention group, its blocks from position 0
    up to the block of the last token, and for each Mamba group position 0
    and exactly the running-state block (the block NIXL transfers, also
    found from the clipped `remote_block_ids`), never the prefill checkpoint
    block before it nor, with `SPEC` n-gram speculative tokens, a scratch
    block after it; the payload equals the independent references for all
    three groups. A second request extending the prompt starts from a
    prefix-cache hit (attention blocks and Mamba checkpoint reused) and is
    checked the same way.

    Bugs caught: one kind of group selected by the other's rule (Mamba by
    token range: positions != 0 and several blocks from 33 tokens on;
    attention by the Mamba rule: one block); the attention group dropped
    when a Mamba group is present; the first real Mamba block taken instead
    of the running state (the Mamba checkpoint block a prefix-cache hit
    leaves before it: the second request from 17 tokens on); "take the last
    block" with scratch blocks (every length with num_spec = 2); slots
    past the last token counted (garbage there differs from the reference);
    cached blocks left out of a producer's checksums."""
    model = write_nemotron_h(str(tmp_path), 1)
    side = build_side(
        model, 1, 1, "producer", distributed, monkeypatch, num_spec=num_spec
    )
    bs = side.block_size
    for req_id, prompt in (
        ("p", prompt_of(length)),
        ("hit", prompt_of(length) + prompt_of(length, offset=1)),
    ):
        states = mamba_states(len(prompt), 1, num_spec)
        produced = produce(side, req_id, prompt, states)
        n = produced.num_tokens
        sent = produced.sent
        assert sent.num_tokens == n
        assert sorted(sent.groups) == side.all_groups
        position, ids = sent.groups[side.attention_group]
        attention_blocks = produced.blocks[side.attention_group]
        assert position == 0
        assert ids.tolist() == attention_blocks[: cdiv(n, bs)]
        remote = per_group(produced.params["remote_block_ids"])
        for layer, group_id in side.mamba_groups.items():
            position, ids = sent.groups[group_id]
            assert position == 0
            assert ids.tolist() == [produced.state_blocks[layer]]
            assert clip_ssm_state_blocks(remote[group_id], num_spec) == ids.tolist()
        check_payload(side, produced, prompt, states)
        if req_id == "hit":
            # The first request's N - 1 tokens left full attention blocks and
            # a Mamba state at each block boundary short of its last token.
            first = length - 1
            assert produced.cached_tokens == (first - 1) // bs * bs


@pytest.mark.parametrize("fault", ["none", "attention", "mamba_conv", "mamba_ssm"])
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize(
    ("tp_pair", "n_groups", "num_spec"),
    [
        ((1, 1), 1, 0),
        ((2, 1), 1, 0),
        ((1, 2), 1, 0),
        ((2, 2), 2, 0),
        ((1, 1), 1, SPEC),
    ],
    ids=["tp1-tp1", "tp2-tp1", "tp1-tp2", "tp2-tp2-g2", "tp1-tp1-spec2"],
)
def test_consumer_load_round_trip_r67_r85(
    distributed: Any,
    tmp_path: Any,
    hybrid_platform: None,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    tp_pair: tuple[int, int],
    n_groups: int,
    num_spec: int,
    length: int,
    fault: str,
) -> None:
    """R64, R67, R70, R85-R93 end to end through two real schedulers of the
    hybrid model: the producer's payload (checked against the references)
    travels in kv_transfer_params; the consumer's load of N - 1 tokens
    registers the attention blocks from position 0 and, per Mamba group,
    position 0 and its running-state block; with the same bytes copied the
    verdict is VERIFIED with all three groups compared (producer TP ->
    consumer TP: 1 -> 1, 2 -> 1, 1 -> 2 with one Mamba group (B/C replicated),
    2 -> 2 with two, 1 -> 1 with `SPEC` speculative scratch blocks after
    each running state); one flipped byte is a MISMATCH at exactly its group and
    position: the last loaded token's attention block, or position 0 of
    layer 0's (conv state: a B channel, replicated at TP 2 with one group) or
    layer 2's (SSM state) Mamba group.

    Bugs caught: "take the last block" for Mamba with scratch blocks (the
    spec2 loads would not verify: the state is not there); the Mamba groups
    left out of verification or of the producer's payload (a flipped state
    verifies, or the compared groups miss them); the attention group dropped
    when a Mamba group is present (an attention flip verifies); a Mamba
    group selected by token range like attention (positions != 0, several
    blocks); the last partial attention block not compared (the flips at 5,
    17, 40, 70); garbage past the last token counted (every clean load would
    mismatch); a mismatch reported at the wrong group or position; per-rank
    row or head numbering across TP sizes (2 -> 1, 1 -> 2 would mismatch);
    B/C replicas of the last rank left unchecked (the 1 -> 2 conv flip)."""
    model = write_nemotron_h(str(tmp_path), n_groups)
    p_tp, c_tp = tp_pair
    producer = build_side(
        model, p_tp, n_groups, "producer", distributed, monkeypatch, num_spec
    )
    consumer = build_side(
        model, c_tp, n_groups, "consumer", distributed, monkeypatch, num_spec
    )
    assert consumer.all_groups == producer.all_groups
    assert consumer.block_size == producer.block_size
    prompt = prompt_of(length)
    states = mamba_states(length, n_groups, num_spec)
    produced = produce(producer, "r", prompt, states)
    check_payload(producer, produced, prompt, states)

    recv, blocks, loaded, verdict = consume_load(
        consumer, "r", prompt, produced.params, states, fault
    )
    bs = consumer.block_size
    assert recv.num_tokens == loaded
    assert sorted(recv.groups) == consumer.all_groups
    position, ids = recv.groups[consumer.attention_group]
    assert position == 0
    assert ids.tolist() == blocks[consumer.attention_group][: cdiv(loaded, bs)]
    for group_id in consumer.mamba_groups.values():
        position, ids = recv.groups[group_id]
        assert position == 0
        state_block = running_state_block(blocks[group_id], loaded, bs, num_spec)
        assert ids.tolist() == [state_block]
    expected = {
        "none": {},
        "attention": {consumer.attention_group: [(loaded - 1) // bs]},
        "mamba_conv": {consumer.mamba_groups[0]: [0]},
        "mamba_ssm": {consumer.mamba_groups[2]: [0]},
    }[fault]
    assert sorted(verdict.compared_groups) == consumer.all_groups, verdict
    assert not verdict.reasons, verdict
    assert verdict.mismatches == expected
    if fault == "none":
        assert verdict.status == KVChecksumStatus.VERIFIED, verdict
    else:
        assert verdict.status == KVChecksumStatus.MISMATCH, verdict


def test_hybrid_containment_knows_the_state_groups_r138(
    distributed: Any,
    tmp_path: Any,
    hybrid_platform: None,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R138, issue 32 item 3, on vLLM's own hybrid KV cache config: the
    wiring hands containment the Mamba groups as per-request state groups
    (the attention group not), so a failed load after a local prefix hit is
    quarantined from the attention group's first bad loaded position, not
    from the Mamba block's position 0. Bug caught: no state groups passed
    (every group quarantined from token 0, the shared hit blocks unhashed)."""
    model = write_nemotron_h(str(tmp_path), 1)
    side = build_side(model, 1, 1, "contain", distributed, monkeypatch)
    containment = getattr(side.scheduler, "kv_checksum_containment", None)
    if containment is None:
        pytest.skip("prefix caching off for this hybrid config: nothing to contain")
    assert containment.state_groups == set(side.mamba_groups.values())
    attention = side.attention_group
    groups = {attention: (2, np.arange(5, 8))}
    groups.update({g: (0, np.array([20 + g])) for g in side.mamba_groups.values()})
    blocks = KVChecksumBlocks(num_tokens=5 * side.block_size, groups=groups)
    mamba = next(iter(side.mamba_groups.values()))
    verdict = KVChecksumVerdict(KVChecksumStatus.MISMATCH, {mamba: [0]})
    # The same rule on marks kept apart ("x" is no request of the engine).
    apart = type(containment)(
        containment.block_sizes, False, state_groups=containment.state_groups
    )
    start = apart.on_failed_load("x", verdict, blocks)
    assert start[attention] == 2


def run_local(side: HybridSide, req_id: str, prompt: list[int]) -> int:
    """Run a plain request to its end; returns the tokens its first step
    found in the prefix cache."""
    side.scheduler.add_request(
        make_request(
            req_id, prompt, max_tokens=1, block_size=side.scheduler.hash_block_size
        )
    )
    request = side.scheduler.requests[req_id]
    hit = None
    for _ in range(MAX_MODEL_LEN):
        if req_id in side.finals:
            break
        output = side.scheduler.schedule()
        if hit is None:
            hit = request.num_computed_tokens - output.num_scheduled_tokens[req_id]
        side.finish(output)
    assert req_id in side.finals and hit is not None
    return hit


@pytest.mark.kv_checksum_capability("containment")
def test_hybrid_failed_load_after_a_local_hit_keeps_the_hit_r138(
    distributed: Any,
    tmp_path: Any,
    hybrid_platform: None,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R138, issue 32 item 3, end to end on vLLM's real Scheduler and KV
    cache manager of the hybrid model (fail-closed, policy "fail"): a local
    request caches a prefix of two blocks; a P/D request over the same prefix
    hits them locally and loads the rest, and that load fails verification
    (no producer checksums: unverified, so every loaded group is bad from its
    first loaded position, the Mamba group from position 0). Quarantine
    starts at the attention group's first loaded position (2), in every
    group; the request fails; a third request over the prefix still hits the
    two shared blocks.

    Bug this fails (checked by reverting containment's state-group rule):
    the Mamba group's position 0 counted as the first bad token, so every
    group is quarantined from position 0 and the shared prefix-hit blocks
    lose their hashes (the third request hits nothing)."""
    model = write_nemotron_h(str(tmp_path), 1)
    side = build_side(model, 1, 1, "hit-then-load", distributed, monkeypatch)
    bs = side.block_size
    prompt = prompt_of(3 * bs + 9)
    assert run_local(side, "local", prompt[: 2 * bs + 5]) == 0
    starts: list[dict[int, int]] = []
    # Told each containment's first quarantined positions (plugin and vLLM).
    side.scheduler.kv_checksum_scheduler.contained_listeners.append(
        lambda req_id, start: starts.append(dict(start))
    )
    params = consumer_kv_transfer_params("r", remote_block_ids=[[1, 2, 3]] * 3)
    side.scheduler.add_request(
        make_request(
            "r",
            prompt,
            max_tokens=2,
            kv_transfer_params=params,
            block_size=side.scheduler.hash_block_size,
        )
    )
    output = side.scheduler.schedule()
    assert output.kv_checksum_scheduled is not None
    recv = output.kv_checksum_scheduled.reqs_to_recv["r"]
    assert recv.groups[side.attention_group][0] == 2  # after the local hit
    for group_id in side.mamba_groups.values():
        assert recv.groups[group_id][0] == 0
    side.finish(output)
    side.finish(side.scheduler.schedule(), finished_recving={"r"})
    ((req_id, verdict),) = side.verdicts
    assert req_id == "r" and verdict.status == KVChecksumStatus.UNVERIFIED
    assert starts == [{g: 2 for g in side.all_groups}]
    for _ in range(3):
        if "r" in side.finals:
            break
        side.finish(side.scheduler.schedule())
    assert side.finals["r"].finish_reason is not None
    assert run_local(side, "again", prompt[: 2 * bs + 7]) == 2 * bs
