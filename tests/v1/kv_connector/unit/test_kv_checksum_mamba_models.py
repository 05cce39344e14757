# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba state checksums on real vLLM 0.33.0 models built on CPU (R36-R45, R85).

A tiny MambaForCausalLM or Mamba2ForCausalLM (vLLM's model classes, from
transformers configs), or two of vLLM's Qwen3-Next GDN layers
(QwenGatedDeltaNetAttention from a Qwen3NextConfig; the whole Qwen3-Next model
does not build on CPU: its MoE layers find no CPU backend), is built per TP
rank in one process: the TP group is a real one-process gloo group whose size
and rank are set to the simulated (TP, rank) while the model is constructed, so
vLLM's layers shard themselves (and pad one group to TP groups) as they would
on that rank. Everything after that is vLLM's own path: `get_kv_cache_spec`
through the plugin's hook (attaching `state_splits`), pickling as to the engine
core, `get_global_kv_cache_groups` and `get_kv_cache_configs`,
`allocate_kv_cache`, and each layer's `bind_kv_cache`, whose per-state views
receive the truth. The truth is a global (TP = 1) state per layer, sharded by
the test the way vLLM shards it (every segment and the heads split; Mamba2's B
and C whole on every rank with one group); the expected checksum comes from the
independent reference of `test_kv_checksum_mamba` (global rows: conv segments
in TP = 1 order, then heads).
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.test_kv_checksum_mamba import (
    U64,
    GlobalState,
    reference_layer_checksum,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    KVChecksumWorker,
    WorkerTopology,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumWorkerReport,
    build_producer_payload,
    verify_load,
)

pytestmark = [pytest.mark.cpu, pytest.mark.kv_checksum_capability("hybrid")]

HIDDEN, HEADS, HEAD_DIM, STATE, LAYERS = 64, 4, 32, 8, 2
INTERMEDIATE = HEADS * HEAD_DIM  # expand 2
# GDN: key heads, value heads, key and value head dims
KH, VH, KD, VD = 2, 4, 16, 16
BLOCK = 5


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-process gloo world; yields vLLM's TP group coordinator."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.distributed.parallel_state import get_tp_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(tmp_path_factory.mktemp("mamba2"))
    with set_current_vllm_config(make_config(write_mamba2(model, 1), 1)):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    group = get_tp_group()
    try:
        yield group
    finally:
        group.world_size, group.rank_in_group = 1, 0
        destroy_model_parallel()
        destroy_distributed_environment()


def write_mamba2(folder: str, n_groups: int) -> str:
    import transformers

    transformers.Mamba2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        n_groups=n_groups,
        state_size=STATE,
        expand=2,
        vocab_size=256,
    ).save_pretrained(folder)
    return folder


def write_mamba1(folder: str) -> str:
    import transformers

    transformers.MambaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        state_size=STATE,
        expand=2,
        conv_kernel=4,
        vocab_size=256,
    ).save_pretrained(folder)
    return folder


def write_qwen3_next(folder: str) -> str:
    import transformers

    transformers.Qwen3NextConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=VH,
        linear_num_key_heads=KH,
        linear_key_head_dim=KD,
        linear_value_head_dim=VD,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        vocab_size=256,
    ).save_pretrained(folder)
    return folder


def layer_names(family: str) -> list[str]:
    if family == "gdn":
        return [f"model.layers.{i}.linear_attn" for i in range(LAYERS)]
    return [f"backbone.layers.{i}.mixer" for i in range(LAYERS)]


def build_layers(family: str, config: Any) -> None:
    """vLLM's modules, registering their Mamba layers in the forward context."""
    if family == "gdn":
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        hf_config = config.model_config.hf_config
        for name in layer_names(family):
            QwenGatedDeltaNetAttention(hf_config, config, prefix=name)
        return
    if family == "mamba1":
        from vllm.model_executor.models.mamba import MambaForCausalLM

        MambaForCausalLM(vllm_config=config, prefix="")
        return
    from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM

    Mamba2ForCausalLM(vllm_config=config, prefix="")


def make_config(model: str, tp: int) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    config = VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256
        ),
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"enable_kv_checksum": True},
        ),
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


@dataclasses.dataclass
class RankEngine:
    """One simulated rank: its layers (with bound states), config and worker."""

    layers: dict[str, Any]
    kv_cache_config: Any
    worker: KVChecksumWorker


def build_rank(
    family: str, model: str, tp: int, rank: int, group: Any, monkeypatch: Any
) -> RankEngine:
    """vLLM's model, specs, KV cache config and caches for (TP, rank)."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import register_plugin
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.utils import allocate_kv_cache

    register_plugin()
    # The GDN layer puts a buffer on the current device; the CPU test
    # platform has none.
    monkeypatch.setattr(
        current_platform, "current_device", lambda: torch.device("cpu"), raising=False
    )
    config = make_config(model, tp)
    # Layers read the TP size when built and when binding their states.
    group.world_size, group.rank_in_group = tp, rank
    try:
        with set_current_vllm_config(config):
            build_layers(family, config)
            specs = pickle.loads(pickle.dumps(get_kv_cache_spec(config)))
            groups = get_global_kv_cache_groups(config, [specs])
            page = next(iter(specs.values())).page_size_bytes
            (kv_cache_config,) = get_kv_cache_configs(
                config, [specs], [16 * LAYERS * page], groups
            )
            kv_cache_config = pickle.loads(pickle.dumps(kv_cache_config))
            caches = allocate_kv_cache(
                kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC
            )
            layers = dict(config.compilation_config.static_forward_context)
            for name, layer in layers.items():
                layer.bind_kv_cache(caches[name])
    finally:
        group.world_size, group.rank_in_group = 1, 0
    topo = WorkerTopology(
        rank, tp, 0, kv_cache_config.num_blocks, None, torch.device("cpu")
    )
    return RankEngine(
        layers, kv_cache_config, KVChecksumWorker(kv_cache_config, caches, topo)
    )


def random_state(rng: np.random.Generator, family: str, n_groups: int) -> GlobalState:
    """Global conv rows (Mamba2 x, B, C; GDN Q, K, V) and heads, bf16 bits."""
    if family == "gdn":
        sizes, heads = (KH * KD, KH * KD, VH * VD), (VH, VD, KD)
    elif family == "mamba1":  # conv [x], temporal [channels]
        sizes, heads = (2 * HIDDEN,), (2 * HIDDEN, STATE)
    else:
        bc = n_groups * STATE
        sizes, heads = (INTERMEDIATE, bc, bc), (HEADS, HEAD_DIM, STATE)
    conv = [rng.integers(0, 1 << 16, size=(n, 3), dtype=np.uint16) for n in sizes]
    temporal = rng.integers(0, 1 << 16, size=heads, dtype=np.uint16)
    return GlobalState(conv, temporal)


def shard(rows: np.ndarray, tp: int, rank: int) -> np.ndarray:
    size = rows.shape[0] // tp
    return rows[rank * size : (rank + 1) * size]


def write_state(
    engine: RankEngine,
    name: str,
    state: GlobalState,
    tp: int,
    rank: int,
    n_groups: int,
) -> None:
    """Shard the global state as vLLM does and write it through vLLM's views:
    every conv segment and the heads split, except Mamba2's B and C with one
    group, which every rank holds whole."""
    if n_groups == 1:
        first, b, c = state.conv
        parts = [shard(first, tp, rank), b, c]
    else:
        parts = [shard(segment, tp, rank) for segment in state.conv]
    conv = np.concatenate(parts)  # [channels, state_len]
    conv_view, ssm_view = engine.layers[name].kv_cache[:2]
    local = torch.from_numpy(conv.view(np.int16))
    # vLLM's default (SD) conv layout is (state_len, channels).
    conv_view[BLOCK].view(torch.int16).copy_(
        local.T if conv_view.shape[1] != conv.shape[0] else local
    )
    temporal = shard(state.temporal, tp, rank)
    ssm_view[BLOCK].view(torch.int16).copy_(torch.from_numpy(temporal.view(np.int16)))


def blocks() -> KVChecksumBlocks:
    return KVChecksumBlocks(40, {0: (0, np.array([BLOCK], dtype=np.int64))})


def side_reports(engines: list[RankEngine], send: bool) -> dict:
    out = {}
    for rank, engine in enumerate(engines):
        step = KVChecksumScheduled(
            reqs_to_send={"r": blocks()} if send else {},
            reqs_to_recv={} if send else {"r": blocks()},
        )
        engine.worker.bind(step)
        pending = engine.worker.post_forward(None if send else ["r"])
        assert pending is not None
        report = KVChecksumWorkerReport.from_record(pending.finalize(), "r")
        assert report is not None
        out[(0, rank)] = report
    return out


def scheduler_of(engine: RankEngine, tp: int) -> KVChecksumScheduler:
    return KVChecksumScheduler.create(
        engine.kv_cache_config,
        num_workers=tp,
        tp_size=tp,
        fail_closed=True,
        carrier=lambda request, receiving: None,
        hit_sources=lambda request, n: set(),
        max_model_len=256,
        max_payload_bytes=1 << 20,
    )


@pytest.mark.parametrize(
    ("family", "n_groups"),
    [("mamba1", 0), ("mamba2", 1), ("mamba2", 2), ("gdn", 0)],
)
@pytest.mark.parametrize("tp_pair", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_real_models_verify_and_catch_flips_r39_r40(
    distributed: Any,
    tmp_path: Any,
    cuda_stream_stubs: Any,
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    n_groups: int,
    tp_pair: tuple[int, int],
) -> None:
    """R39-R40, R44, R85 on vLLM's Mamba1 and Mamba2 models (one group: B/C
    replicated on every rank; two: sharded) and Qwen3-Next GDN layers: specs carry the
    plugin's splits through vLLM's planning (the scheduler marks the group
    Mamba and TP-comparable), the producer's payload equals the independent
    reference, a clean load verifies at TP 1->1, 1->2, 2->1, 2->2, and a
    flipped byte of the last rank's second conv segment (Mamba2 B: a replica
    with one group; GDN K) mismatches. Bugs caught: splits lost between layer
    and group spec (the 1->2 loads would be left out, not compared), per-rank
    row numbering, B/C replicas unchecked, the padded group count read as
    the checkpoint's."""
    if family == "gdn":
        model = write_qwen3_next(str(tmp_path))
    elif family == "mamba1":
        model = write_mamba1(str(tmp_path))
    else:
        model = write_mamba2(str(tmp_path), n_groups)
    names = layer_names(family)
    p_tp, c_tp = tp_pair
    rng = np.random.default_rng(n_groups)
    states = [random_state(rng, family, n_groups) for _ in range(LAYERS)]
    sides = []
    for tp in (p_tp, c_tp):
        engines = [
            build_rank(family, model, tp, r, distributed, monkeypatch)
            for r in range(tp)
        ]
        for rank, engine in enumerate(engines):
            for name, state in zip(names, states):
                write_state(engine, name, state, tp, rank, n_groups)
        sides.append(engines)
    producer, consumer = sides
    p_sched, c_sched = scheduler_of(producer[0], p_tp), scheduler_of(consumer[0], c_tp)
    info = c_sched.group_infos[0]
    assert info.is_mamba and info.tp_comparable

    sent = side_reports(producer, send=True)
    payload = build_producer_payload(sent, blocks(), p_tp, p_tp, p_sched.group_infos)
    assert not isinstance(payload, str)
    expected = sum(reference_layer_checksum(n, states[n]) for n in range(LAYERS))
    assert int(payload.groups[0].values.astype(U64)[0]) == expected % (1 << 64)

    def verdict() -> Any:
        received = side_reports(consumer, send=False)
        return verify_load(
            payload, None, received, blocks(), c_tp, c_tp, c_sched.group_infos
        )

    assert verdict().status == KVChecksumStatus.VERIFIED
    # One byte of the last rank's second conv segment (Mamba2 B, GDN K) or,
    # for Mamba1, its last x channel; first state slot.
    conv = consumer[-1].layers[names[1]].kv_cache[0]
    b_channel = states[1].conv[0].shape[0] // c_tp - (family == "mamba1")
    cell = conv[BLOCK].view(torch.int16)
    if cell.shape[0] == 3:  # SD: (state_len, channels)
        cell[0, b_channel] ^= 1 << 9
    else:
        cell[b_channel, 0] ^= 1 << 9
    result = verdict()
    assert result.status == KVChecksumStatus.MISMATCH
    assert result.mismatches == {0: [0]}
