# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU test harness for KV checksums on a real vLLM 0.33.0 scheduler.

Import as ``from tests.v1.kv_connector.unit.kv_checksum_helpers import ...``
(pytest puts the repository root on ``sys.path`` because ``tests/`` is a
package).

What it provides:

* ``write_model_dir`` / ``make_vllm_config``: a ``VllmConfig`` for a tiny
  Qwen3-style model whose folder holds only ``config.json`` (no weights, no
  tokenizer, no hub). TP/PP sizes are config values only; nothing is spawned.
* ``make_kv_cache_config``: a ``KVCacheConfig`` with full-attention,
  sliding-window or both kinds of groups, and ``KVCacheTensor`` placements for
  any ``KVCacheLayout``.
* ``make_kv_caches``: vLLM's own per-layer KV cache views
  (``allocate_kv_cache``) filled with seeded random bytes.
* ``make_scheduler``: a real ``Scheduler`` or ``AsyncScheduler``.
* ``make_request``, ``consumer_kv_transfer_params``,
  ``producer_kv_transfer_params``: requests as a P/D proxy sends them.
* ``make_model_runner_output``, ``make_kv_connector_output``, ``step`` and
  ``StepDriver``: emulate the model runner and the engine loop, with the test
  deciding in which step a KV load is reported finished or failed.
* ``KVChecksumTestConnector``: a minimal connector simulating asynchronous
  P2P loads (NIXL-like scheduler side, no-op worker side), registered with
  ``KVConnectorFactory`` under ``TEST_CONNECTOR_NAME``.
* ``CpuStream`` / ``CpuEvent``: CPU stand-ins for CUDA streams and events used
  by the ``cuda_stream_stubs`` fixture (conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.utils import get_pp_indices
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

# --------------------------------------------------------------------------
# Model folder and configs
# --------------------------------------------------------------------------

NUM_LAYERS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 16
NUM_BLOCKS = 128
SLIDING_WINDOW = 32
MAX_MODEL_LEN = 1024
DTYPE = torch.bfloat16

# Token every emulated model step samples unless a test says otherwise. The
# model's eos_token_id is 2, so this never stops a request by itself.
DEFAULT_SAMPLED_TOKEN = 100

TEST_CONNECTOR_NAME = "KVChecksumTestConnector"
# Engine name a producer reports as "remote_engine_id"
# (override: kv_connector_extra_config["test_engine_name"]).
PRODUCER_ENGINE_ID = "producer"
# vllm_config.additional_config key holding the harness parameters that a
# VllmConfig itself cannot express (KV cache groups and sliding window).
HARNESS_CONFIG_KEY = "kv_checksum_harness"

GroupsKind = Literal["full", "sliding", "both", "mla"]
# "mla": one latent cache per layer as vLLM 0.33.0 lays out MLA (one head slot
# of kv_lora_rank + qk_rope_head_dim elements, the same on every TP rank).
MLA_KV_LORA_RANK = 32
MLA_ROPE_DIM = 16
MLA_LATENT_DIM = MLA_KV_LORA_RANK + MLA_ROPE_DIM

MODEL_CONFIG_JSON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": NUM_LAYERS,
    "max_position_embeddings": 4096,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# The settings that are KVTransferConfig fields on a vLLM with the series.
NATIVE_SETTING_KEYS = (
    "enable_kv_checksum",
    "kv_checksum_fail_closed",
    "kv_checksum_max_payload_bytes",
    "kv_checksum_fault_injection",
    "kv_checksum_verify_prefix_hits",
)


def native_kv_checksums() -> bool:
    """Whether this vLLM has KV checksums built in (the in-tree series under
    `upstream/`): the plugin and its wiring are not installed there, and the
    behaviour tests run against vLLM's own calls."""
    return (
        importlib.util.find_spec("vllm.distributed.kv_transfer.kv_checksum.plugin")
        is None
    )


def native_capability(capability: str) -> bool:
    """On a vLLM with the in-tree series: whether the series has wired
    `capability` into vLLM yet (each capability's commit is detected by what
    it adds to vLLM). On vLLM 0.33.0 the plugin carries them all."""
    if not native_kv_checksums():
        return True
    if capability == "plugin":  # the plugin's own code (wiring, scripts)
        return False
    if capability == "nixl_push":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPushConnector,
        )

        return "kv_checksum_carrier" in NixlPushConnector.__dict__
    if capability == "hybrid":
        from vllm.v1.kv_cache_interface import MambaSpec

        return "state_splits" in MambaSpec.__dataclass_fields__
    if capability == "offloading":  # OffloadingConnector's CPU backend
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        return "get_kv_checksum_sources" in OffloadingConnector.__dict__
    if capability == "simple_cpu_offload":  # SimpleCPUOffloadConnector (CPU)
        from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
            SimpleCPUOffloadConnector,
        )

        return "get_kv_checksum_sources" in SimpleCPUOffloadConnector.__dict__
    if capability == "mooncake":  # MooncakeConnector (P2P)
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E501
            MooncakeConnector,
        )

        return "kv_checksum_carrier" in MooncakeConnector.__dict__
    if capability == "prefix_hits":  # local prefix-cache hits (R140)
        from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
            KVChecksumScheduler,
        )

        return "attach_prefix_cache" in KVChecksumScheduler.__dict__
    if capability == "external_loads":  # loads from external caches (R147)
        import importlib.util

        module = "vllm.distributed.kv_transfer.kv_checksum.engine.external_loads"
        return importlib.util.find_spec(module) is not None
    if capability == "metrics":  # verdict counts in SchedulerStats, Prometheus
        from vllm.v1.metrics.stats import SchedulerStats

        return "kv_checksum_stats" in SchedulerStats.__dataclass_fields__
    if capability == "containment":  # failed loads kept out of caches, tiers
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E501
            OffloadingConnectorScheduler,
        )
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        return hasattr(KVCacheManager, "stop_caching") and hasattr(
            OffloadingConnectorScheduler, "get_stored_keys"
        )
    return False  # the series has no commit for it yet


def prefix_hit_verifier(scheduler: Any) -> Any:
    """The scheduler's prefix-hit verifier (`PrefixHitVerifier`, on its
    checksum scheduler) while verification runs; None once it is off."""
    kcs = scheduler.kv_checksum_scheduler
    verifier = None if kcs is None else kcs.prefix_hits
    return None if verifier is None or verifier.released else verifier


def capability_skip_reason(capability: str) -> str:
    """Why a test of `capability` is skipped on a vLLM with the series."""
    if capability == "plugin":
        return "tests the plugin itself, which a vLLM with the series does not load"
    return f"the in-tree series has no {capability} commit yet"


def skip_unless_capability(capability: str) -> None:
    """Skip the calling test on a vLLM with the in-tree series when the series
    does not carry `capability` yet (its commit comes later)."""
    import pytest

    if not native_capability(capability):
        pytest.skip(capability_skip_reason(capability))


def register_plugin() -> None:
    """The plugin's registration on vLLM 0.33.0 (its hooks); nothing on a vLLM
    with the subsystem built in."""
    if not native_kv_checksums():
        from vllm.distributed.kv_transfer.kv_checksum import plugin

        plugin.register()


def write_model_dir(path: str | Path) -> str:
    """Create ``path`` holding only the tiny model's ``config.json``."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG_JSON, indent=1))
    return str(folder)


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def register_test_connector() -> None:
    """Register ``KVChecksumTestConnector`` with vLLM's factory (idempotent).

    Must run before a ``VllmConfig`` naming it is built: ``VllmConfig``'s
    post-init asks the factory whether the connector supports HMA.
    """
    with contextlib.suppress(ValueError):  # already registered
        KVConnectorFactory.register_connector(
            TEST_CONNECTOR_NAME, __name__, "KVChecksumTestConnector"
        )


def make_vllm_config(
    model_dir: str,
    *,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
    groups: GroupsKind = "full",
    sliding_window: int = SLIDING_WINDOW,
    tp_size: int = 1,
    pp_size: int = 1,
    kv_connector: str | None = TEST_CONNECTOR_NAME,
    kv_role: str = "kv_both",
    extra_config: Mapping[str, Any] | None = None,
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail",
    max_model_len: int = MAX_MODEL_LEN,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int | None = None,
    kv_cache_layout: KVCacheLayout | None = None,
    engine_id: str | None = None,
) -> VllmConfig:
    """A ``VllmConfig`` for the tiny model in ``model_dir`` on CPU.

    ``kv_connector=None`` builds no ``KVTransferConfig``. ``extra_config`` is
    ``kv_connector_extra_config`` (where the checksum flags live, R8).
    ``tp_size``/``pp_size`` only set ``ParallelConfig`` (executor backend
    "mp" when > 1, never started). ``groups`` and ``sliding_window`` are kept
    in ``additional_config[HARNESS_CONFIG_KEY]`` for ``make_kv_cache_config``.
    ``cache_config.num_gpu_blocks`` is set to ``num_blocks``;
    ``kv_cache_layout`` (if given) pre-resolves ``cache_config.kv_cache_layout``.
    """
    if kv_connector == TEST_CONNECTOR_NAME:
        register_test_connector()
    world_size = tp_size * pp_size
    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max_model_len,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    parallel_config = ParallelConfig(
        tensor_parallel_size=tp_size,
        pipeline_parallel_size=pp_size,
        distributed_executor_backend="mp" if world_size > 1 else "uni",
    )
    kv_transfer_config = None
    if kv_connector is not None:
        extra, fields = dict(extra_config or {}), {}
        if native_kv_checksums():  # the settings are KVTransferConfig fields there
            fields = {k: extra.pop(k) for k in NATIVE_SETTING_KEYS if k in extra}
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config=extra,
            kv_load_failure_policy=kv_load_failure_policy,
            engine_id=engine_id,
            **fields,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        additional_config={
            HARNESS_CONFIG_KEY: {"groups": groups, "sliding_window": sliding_window}
        },
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if kv_cache_layout is not None:
        vllm_config.cache_config.kv_cache_layout = kv_cache_layout.name
    return vllm_config


# --------------------------------------------------------------------------
# KV cache config and per-layer KV cache views
# --------------------------------------------------------------------------


def _harness_params(vllm_config: VllmConfig | None) -> dict[str, Any]:
    if vllm_config is None or not isinstance(vllm_config.additional_config, dict):
        return {}
    return dict(vllm_config.additional_config.get(HARNESS_CONFIG_KEY, {}))


def group_layer_indices(groups: GroupsKind, num_layers: int) -> list[list[int]]:
    """Layer numbers of each KV cache group, in group order.

    "full", "sliding" and "mla": one group with every layer. "both": group 0 is
    full attention over the odd layers, group 1 sliding window over the even
    layers (a 1:1 hybrid; vLLM's hybrid groups hold equally many layers).
    """
    if groups in ("full", "sliding", "mla"):
        return [list(range(num_layers))]
    if groups == "both":
        return [list(range(1, num_layers, 2)), list(range(0, num_layers, 2))]
    raise ValueError(f"unknown groups kind {groups!r}")


def build_kv_cache_tensors(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    *,
    alias_groups: bool = False,
) -> list[KVCacheTensor]:
    """One ``KVCacheTensor`` per group, placed as ``layout`` prescribes.

    Strides come from vLLM's ``compute_layout_strides``. With
    ``alias_groups=False`` (default) every group gets its own region of the
    backing allocation, so every (layer, block) page owns distinct bytes.
    ``alias_groups=True`` overlays all groups from byte 0 as vLLM does for
    hybrid models (sound there because a block ID belongs to one group at a
    time). All tensors report the same backing ``size``.
    """
    placements: list[tuple[list[str], int, int, int]] = []
    offset = 0
    size = 0
    for group in kv_cache_groups:
        if not group.layer_names:
            continue
        spec = group.kv_cache_spec
        num_layers = len(group.layer_names)
        strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
        region = num_layers * num_blocks * spec.page_size_bytes
        group_offset = 0 if alias_groups else offset
        placements.append(
            (list(group.layer_names), strides[0], strides[1], group_offset)
        )
        offset += region
        size = max(size, group_offset + region)
    return [
        KVCacheTensor(
            size=size,
            layers=layers,
            layer_stride=layer_stride,
            block_stride=block_stride,
            offset=group_offset,
        )
        for layers, layer_stride, block_stride, group_offset in placements
    ]


def make_kv_cache_config(
    vllm_config: VllmConfig | None = None,
    *,
    groups: GroupsKind | None = None,
    num_layers: int = NUM_LAYERS,
    block_size: int | None = None,
    num_blocks: int | None = None,
    num_kv_heads: int | None = None,
    head_size: int = HEAD_DIM,
    dtype: torch.dtype = DTYPE,
    sliding_window: int | None = None,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    pp_rank: int | None = None,
    alias_groups: bool = False,
) -> KVCacheConfig:
    """A ``KVCacheConfig`` with layers named ``model.layers.{i}.self_attn.attn``.

    Unset arguments come from ``vllm_config`` (block size, ``num_gpu_blocks``,
    KV heads per TP rank, PP size, ``groups`` and ``sliding_window`` given to
    ``make_vllm_config``), else from the module defaults (4 layers, 2 KV
    heads, head_dim 64, bf16, block 16, 128 blocks, "full", window 32).

    ``pp_rank=None`` gives the scheduler's view (every layer); an int gives
    that PP stage's worker view (its layers only, split like vLLM's
    ``get_pp_indices``; a group may then be empty). The group structure is
    described in ``group_layer_indices``. ``kv_cache_tensors`` are placed for
    ``layout`` (see ``build_kv_cache_tensors``) and ``kv_cache_layout`` is set
    to its name.
    """
    params = _harness_params(vllm_config)
    pp_size = 1
    if vllm_config is not None:
        block_size = block_size or vllm_config.cache_config.block_size
        num_blocks = num_blocks or vllm_config.cache_config.num_gpu_blocks
        if num_kv_heads is None:
            num_kv_heads = vllm_config.model_config.get_num_kv_heads(
                vllm_config.parallel_config
            )
        pp_size = vllm_config.parallel_config.pipeline_parallel_size
    groups = groups or params.get("groups", "full")
    sliding_window = sliding_window or params.get("sliding_window", SLIDING_WINDOW)
    block_size = block_size or BLOCK_SIZE
    num_blocks = num_blocks or NUM_BLOCKS
    num_kv_heads = num_kv_heads or NUM_KV_HEADS

    stage_layers = range(num_layers)
    if pp_rank is not None:
        start, end = get_pp_indices(num_layers, pp_rank, pp_size)
        stage_layers = range(start, end)

    full = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )
    sliding = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        sliding_window=sliding_window,
    )
    # MLA: one latent "head" per layer, replicated across TP (not sharded).
    mla = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=MLA_LATENT_DIM, dtype=dtype
    )
    specs: list[KVCacheSpec] = {
        "full": [full],
        "sliding": [sliding],
        "both": [full, sliding],
        "mla": [mla],
    }[groups]
    kv_cache_groups = [
        KVCacheGroupSpec([layer_name(i) for i in indices if i in stage_layers], spec)
        for indices, spec in zip(group_layer_indices(groups, num_layers), specs)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=build_kv_cache_tensors(
            kv_cache_groups, num_blocks, layout, alias_groups=alias_groups
        ),
        kv_cache_groups=kv_cache_groups,
        kv_cache_layout=layout.name,
    )


def kv_cache_config_for_layout(
    kv_cache_config: KVCacheConfig,
    layout: KVCacheLayout,
    *,
    alias_groups: bool = False,
) -> KVCacheConfig:
    """A copy of ``kv_cache_config`` whose tensors are placed for ``layout``."""
    return dataclasses.replace(
        kv_cache_config,
        kv_cache_tensors=build_kv_cache_tensors(
            kv_cache_config.kv_cache_groups,
            kv_cache_config.num_blocks,
            layout,
            alias_groups=alias_groups,
        ),
        kv_cache_layout=layout.name,
    )


def kernel_split_supported(layout: KVCacheLayout) -> bool:
    """Whether vLLM can split blocks into smaller kernel blocks for ``layout``
    (each layer's blocks must be dense pages: LBHNC, LBNHC)."""
    return layout.is_layer_compact and layout.is_block_compact


def make_kv_caches(
    kv_cache_config: KVCacheConfig,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    kernel_block_size: int | None = None,
    seed: int = 0,
    *,
    alias_groups: bool = False,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV cache views for ``layout``, filled with random bytes.

    The tensors of ``kv_cache_config`` are re-placed for ``layout`` (see
    ``kv_cache_config_for_layout``), then vLLM's ``allocate_kv_cache`` builds
    one ``[blocks, heads, tokens, 2 * head_size]`` view per layer (dtype of
    the spec) into a single backing buffer. ``kernel_block_size`` splits each
    block into kernel blocks (first dim x ratio, token dim / ratio); vLLM
    raises ``ValueError`` for layouts where that is impossible (see
    ``kernel_split_supported``). The whole buffer gets bytes from a
    ``torch.Generator`` seeded with ``seed``: same seed, same bytes.
    """
    config = kv_cache_config_for_layout(
        kv_cache_config, layout, alias_groups=alias_groups
    )
    kernel_block_sizes = None
    if kernel_block_size is not None:
        kernel_block_sizes = [kernel_block_size] * len(config.kv_cache_groups)
    caches = allocate_kv_cache(config, torch.device(device), layout, kernel_block_sizes)
    if caches:
        fill_random_bytes(next(iter(caches.values())), seed)
    return caches


def fill_random_bytes(view: torch.Tensor, seed: int) -> None:
    """Fill the whole storage behind ``view`` with seeded random bytes."""
    storage = view.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    flat.set_(storage, 0, (storage.nbytes(),))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randint(
        0, 256, (storage.nbytes(),), dtype=torch.uint8, generator=generator
    )
    flat.copy_(noise)


# --------------------------------------------------------------------------
# Scheduler, requests and emulated model steps
# --------------------------------------------------------------------------


def empty_scheduler_output(has_sync_kv_loads: bool = False) -> Any:
    """A SchedulerOutput of vLLM's own class scheduling nothing (a step's
    connector metadata is the caller's to set)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        has_sync_kv_loads=has_sync_kv_loads,
    )


def make_scheduler(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    async_scheduler: bool | None = None,
    log_stats: bool = False,
    include_finished_set: bool = False,
) -> Scheduler:
    """A real ``Scheduler`` (or ``AsyncScheduler``) for the given configs.

    ``async_scheduler=None`` follows ``scheduler_config.async_scheduling`` as
    the engine does. The scheduler's block size is the cache config's.
    """
    from vllm.v1.structured_output import StructuredOutputManager

    if async_scheduler is None:
        async_scheduler = bool(vllm_config.scheduler_config.async_scheduling)
    cls = AsyncScheduler if async_scheduler else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=log_stats,
        include_finished_set=include_finished_set,
    )


def consumer_kv_transfer_params(
    remote_request_id: str,
    *,
    remote_block_ids: Any = None,
    remote_engine_id: str = PRODUCER_ENGINE_ID,
    **extra: Any,
) -> dict[str, Any]:
    """``kv_transfer_params`` a P/D proxy gives a consumer (D) request.

    Normally the producer's returned params; ``extra`` adds or overrides keys
    (e.g. the checksum carrier's).
    """
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": remote_block_ids if remote_block_ids is not None else [],
        "remote_engine_id": remote_engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": "localhost",
        "remote_port": 0,
    }
    params.update(extra)
    return params


def producer_kv_transfer_params(**extra: Any) -> dict[str, Any]:
    """``kv_transfer_params`` a P/D proxy gives a producer (P) request."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    params.update(extra)
    return params


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: Mapping[str, Any] | None = None,
    block_size: int | None = BLOCK_SIZE,
    arrival_time: float | None = None,
) -> Request:
    """A ``vllm.v1.request.Request`` as the engine core builds it.

    ``kv_transfer_params`` travels, deep-copied, in
    ``SamplingParams.extra_args`` as the API server passes it, so the
    connector may mutate it freely. ``block_size`` sets the prefix-cache block
    hasher (sha256, like the engine's default; initialises vLLM's NONE_HASH);
    it must equal the scheduler's block size; ``None`` disables hashing (no
    prefix-cache hits).
    """
    extra_args = None
    if kv_transfer_params is not None:
        extra_args = {"kv_transfer_params": copy.deepcopy(dict(kv_transfer_params))}
    block_hasher = None
    if block_size is not None:
        init_none_hash(sha256)
        block_hasher = get_request_block_hasher(block_size, sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=block_hasher,
    )


def make_kv_connector_output(
    *,
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    finished_sending: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
) -> KVConnectorOutput:
    """The aggregated worker ``KVConnectorOutput`` the scheduler receives.

    As vLLM's ``KVOutputAggregator`` guarantees, a failed load is also a
    finished one: ids in ``failed_recving`` are added to ``finished_recving``.
    """
    failed = set(failed_recving)
    finished = set(finished_recving) | failed
    return KVConnectorOutput(
        finished_sending=set(finished_sending) or None,
        finished_recving=finished or None,
        invalid_block_ids=set(invalid_block_ids),
        failed_recving=failed,
    )


def load_finished(*request_ids: str) -> KVConnectorOutput:
    """Output reporting the async loads of ``request_ids`` as done."""
    return make_kv_connector_output(finished_recving=request_ids)


def load_failed(*request_ids: str) -> KVConnectorOutput:
    """Output reporting the async loads of ``request_ids`` as failed."""
    return make_kv_connector_output(failed_recving=request_ids)


def request_samples(scheduler: Scheduler, request_id: str) -> bool:
    """Whether the model samples a token for ``request_id`` in the step just
    scheduled (not a non-final prefill chunk). Valid right after schedule()."""
    request = scheduler.requests.get(request_id)
    return request is not None and not request.is_prefill_chunk


def make_model_runner_output(
    scheduler_output: SchedulerOutput,
    *,
    scheduler: Scheduler,
    sampled_token_ids: Mapping[str, list[int]] | None = None,
    default_token: int = DEFAULT_SAMPLED_TOKEN,
    kv_connector_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """Emulate one model step for ``scheduler_output``.

    A request whose prefill is unfinished after this step samples nothing;
    others sample ``sampled_token_ids[req_id]`` if given, else
    ``[default_token]``. Call right after ``scheduler.schedule()`` (the
    scheduler's per-request ``is_prefill_chunk`` decides). An empty step still
    carries ``kv_connector_output``, like vLLM's no-forward steps.
    """
    sampled_token_ids = sampled_token_ids or {}
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        if not request_samples(scheduler, req_id):
            sampled.append([])
        else:
            sampled.append(list(sampled_token_ids.get(req_id, [default_token])))
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def step(
    scheduler: Scheduler,
    *,
    sampled_token_ids: Mapping[str, list[int]] | None = None,
    kv_connector_output: KVConnectorOutput | None = None,
    default_token: int = DEFAULT_SAMPLED_TOKEN,
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """One synchronous engine step: schedule() -> model -> update_from_output()."""
    scheduler_output = scheduler.schedule()
    model_output = make_model_runner_output(
        scheduler_output,
        scheduler=scheduler,
        sampled_token_ids=sampled_token_ids,
        default_token=default_token,
        kv_connector_output=kv_connector_output,
    )
    return scheduler_output, scheduler.update_from_output(
        scheduler_output, model_output
    )


def iter_engine_core_outputs(
    engine_core_outputs: Mapping[int, EngineCoreOutputs] | None,
) -> Iterator[EngineCoreOutput]:
    for outputs in (engine_core_outputs or {}).values():
        yield from outputs.outputs


class StepDriver:
    """Drives a scheduler the way ``EngineCore`` does.

    ``depth=1`` is ``EngineCore.step``: schedule, run, update. ``depth=N>1``
    is ``step_with_batch_queue``: up to N scheduled steps are in flight and a
    step's output is processed only when the queue is full or the newest step
    scheduled no tokens, so the AsyncScheduler schedules ahead of outputs.
    The default depth is ``vllm_config.max_concurrent_batches`` (2 with async
    scheduling, else the PP size).

    The emulated model output of a step is built when it is scheduled, from
    the scheduler's state then. ``kv_connector_output`` given to ``step``
    belongs to the step scheduled by that call (what its workers report); it
    reaches the scheduler when that step's output is processed. Outputs are
    collected per request in ``self.outputs``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        depth: int | None = None,
        default_token: int = DEFAULT_SAMPLED_TOKEN,
    ) -> None:
        self.scheduler = scheduler
        if depth is None:
            depth = scheduler.vllm_config.max_concurrent_batches
        assert depth >= 1
        self.depth = depth
        self.default_token = default_token
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.num_steps = 0

    def step(
        self,
        *,
        kv_connector_output: KVConnectorOutput | None = None,
        sampled_token_ids: Mapping[str, list[int]] | None = None,
    ) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs] | None]:
        """Schedule one step; process the oldest in-flight step if due.

        Returns the step just scheduled and the engine outputs processed in
        this call (None when nothing was processed).
        """
        scheduler_output = self.scheduler.schedule()
        model_output = make_model_runner_output(
            scheduler_output,
            scheduler=self.scheduler,
            sampled_token_ids=sampled_token_ids,
            default_token=self.default_token,
            kv_connector_output=kv_connector_output,
        )
        self.in_flight.append((scheduler_output, model_output))
        self.num_steps += 1
        if (
            len(self.in_flight) < self.depth
            and scheduler_output.total_num_scheduled_tokens > 0
        ):
            return scheduler_output, None
        return scheduler_output, self.process_oldest()

    def process_oldest(self) -> dict[int, EngineCoreOutputs] | None:
        """Process the oldest in-flight step's output (None if none)."""
        if not self.in_flight:
            return None
        scheduler_output, model_output = self.in_flight.popleft()
        engine_core_outputs = self.scheduler.update_from_output(
            scheduler_output, model_output
        )
        for output in iter_engine_core_outputs(engine_core_outputs):
            self.outputs[output.request_id].append(output)
        return engine_core_outputs

    def drain(self) -> None:
        """Process every in-flight step."""
        while self.in_flight:
            self.process_oldest()

    def finish_reason(self, request_id: str) -> Any:
        """The finish reason reported for ``request_id`` (None if unfinished)."""
        for output in self.outputs.get(request_id, ()):
            if output.finish_reason is not None:
                return output.finish_reason
        return None

    def is_finished(self, request_id: str) -> bool:
        return self.finish_reason(request_id) is not None

    def output_token_ids(self, request_id: str) -> list[int]:
        return [
            token
            for output in self.outputs.get(request_id, ())
            for token in output.new_token_ids
        ]

    def final_output(self, request_id: str) -> EngineCoreOutput | None:
        """The output carrying ``request_id``'s finish reason, if any."""
        for output in self.outputs.get(request_id, ()):
            if output.finish_reason is not None:
                return output
        return None

    def run_until_finished(
        self, request_ids: Iterable[str], *, max_steps: int = 64
    ) -> None:
        """Step until every request in ``request_ids`` reported a finish."""
        pending = set(request_ids)
        for _ in range(max_steps):
            pending = {rid for rid in pending if not self.is_finished(rid)}
            if not pending:
                self.drain()
                return
            self.step()
        raise AssertionError(
            f"requests not finished after {max_steps} steps: {pending}"
        )


# --------------------------------------------------------------------------
# Test connector
# --------------------------------------------------------------------------


@dataclasses.dataclass
class RecordedLoad:
    """An asynchronous load the test connector started for a request."""

    request_id: str
    # Block IDs per KV cache group when the load started.
    block_ids: tuple[list[int], ...]
    num_external_tokens: int
    # The request's kv_transfer_params at that time (a copy).
    kv_transfer_params: dict[str, Any]


@dataclasses.dataclass
class KVChecksumTestConnectorMetadata(KVConnectorMetadata):
    """Loads started since the previous step, by request id."""

    loads: dict[str, RecordedLoad] = dataclasses.field(default_factory=dict)


class KVChecksumTestConnector(KVConnectorBase_V1, SupportsHMA):
    """Minimal connector simulating asynchronous P2P KV loads.

    Scheduler side (NIXL-like): a request whose ``kv_transfer_params`` has
    ``do_remote_prefill`` gets ``len(prompt) - 1 - num_computed_tokens``
    external tokens, loaded asynchronously; ``update_state_after_alloc``
    records the load and clears ``do_remote_prefill`` (one transfer per
    request). The test reports loads finished/failed through the model
    output (``load_finished`` / ``load_failed``). A finished producer request
    (``do_remote_decode``) returns params for the consumer. Worker side:
    no-ops (``register_kv_caches`` keeps the caches in ``self.kv_caches``).

    ``kv_connector_extra_config`` keys: ``test_engine_name`` (the producer's
    "remote_engine_id", default "producer"), ``test_delay_free`` (producer
    holds blocks until the test reports ``finished_sending``, like NIXL).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.engine_name: str = extra.get("test_engine_name", PRODUCER_ENGINE_ID)
        self.delay_free: bool = bool(extra.get("test_delay_free", False))
        # Scheduler-side state.
        self.started_loads: list[RecordedLoad] = []
        self.pending_loads: dict[str, RecordedLoad] = {}
        self._new_loads: dict[str, RecordedLoad] = {}
        self.finished_params: dict[str, dict[str, Any] | None] = {}
        # Worker-side state.
        self.kv_caches: dict[str, torch.Tensor] = {}

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A P2P transfer of the request's own blocks restores every group.
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if num_external_tokens > 0:
            self.start_load(request, blocks, num_external_tokens)
        # Only one transfer per request.
        params["do_remote_prefill"] = False

    def start_load(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> RecordedLoad:
        """Record a load into `blocks` as started; the test finishes it."""
        load = RecordedLoad(
            request_id=request.request_id,
            block_ids=tuple(list(ids) for ids in blocks.get_block_ids()),
            num_external_tokens=num_external_tokens,
            kv_transfer_params=copy.deepcopy(request.kv_transfer_params),
        )
        self.started_loads.append(load)
        self.pending_loads[request.request_id] = load
        self._new_loads[request.request_id] = load
        return load

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = KVChecksumTestConnectorMetadata(loads=self._new_loads)
        self._new_loads = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            self.pending_loads.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, list(block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(ids) for ids in block_ids])

    def _finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        result: tuple[bool, dict[str, Any] | None] = (False, None)
        if params and params.get("do_remote_prefill"):
            # Finished (aborted) before its load started.
            params["do_remote_prefill"] = False
        elif (
            params
            and params.get("do_remote_decode")
            and request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        ):
            parallel_config = self._vllm_config.parallel_config
            result = (
                self.delay_free,
                {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": block_ids,
                    "remote_engine_id": self.engine_name,
                    "remote_request_id": request.request_id,
                    "remote_host": "localhost",
                    "remote_port": 0,
                    "remote_num_tokens": request.num_computed_tokens,
                    "tp_size": parallel_config.tensor_parallel_size,
                    "pp_size": parallel_config.pipeline_parallel_size,
                },
            )
        self.finished_params[request.request_id] = result[1]
        return result

    # ---- worker side (no-ops) ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


register_test_connector()


# --------------------------------------------------------------------------
# CPU stand-ins for CUDA streams and events (see conftest.cuda_stream_stubs)
# --------------------------------------------------------------------------


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: always complete; calls are logged."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        **kwargs: Any,
    ) -> None:
        self.enable_timing = enable_timing
        self.device = torch.device("cpu")
        self.recorded_on: list[CpuStream] = []
        self.waited_by: list[CpuStream] = []
        self.num_synchronize = 0
        if CpuStreamState._active is not None:
            CpuStreamState._active.created_events.append(self)

    def record(self, stream: CpuStream | None = None) -> None:
        self.recorded_on.append(stream or CpuStreamState.get().current)

    def wait(self, stream: CpuStream | None = None) -> None:
        (stream or CpuStreamState.get().current).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.num_synchronize += 1

    def elapsed_time(self, end_event: CpuEvent) -> float:
        return 0.0


class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: work runs eagerly on CPU, so every
    ordering call is a logged no-op and ``query()`` is always True."""

    def __init__(
        self, device: Any = None, priority: int = 0, name: str = "side", **kwargs: Any
    ) -> None:
        self.device = torch.device("cpu")
        self.device_index = -1  # as torch.Stream(device="cpu")
        self.priority = priority
        self.name = name
        self.cuda_stream = id(self)
        self.waited_streams: list[CpuStream] = []
        self.waited_events: list[CpuEvent] = []
        self.num_synchronize = 0
        if CpuStreamState._active is not None and name != "default":
            CpuStreamState._active.created_streams.append(self)

    def wait_stream(self, stream: CpuStream) -> None:
        self.waited_streams.append(stream)

    def wait_event(self, event: CpuEvent) -> None:
        self.waited_events.append(event)
        event.waited_by.append(self)

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.num_synchronize += 1

    def __enter__(self) -> CpuStream:
        state = CpuStreamState.get()
        state.stack.append(state.current)
        state.set_current(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        state = CpuStreamState.get()
        state.set_current(state.stack.pop())

    def __repr__(self) -> str:
        return f"CpuStream({self.name})"


class CpuStreamState:
    """Current/default stand-in streams while ``cuda_stream_stubs`` is active."""

    _active: CpuStreamState | None = None

    def __init__(self, tls: threading.local | None = None) -> None:
        self.default = CpuStream(name="default")
        self.current = self.default
        self.stack: list[CpuStream] = []
        self.created_streams: list[CpuStream] = []
        self.created_events: list[CpuEvent] = []
        self._tls = tls

    @classmethod
    def get(cls) -> CpuStreamState:
        if cls._active is None:
            raise RuntimeError("cuda_stream_stubs is not active")
        return cls._active

    def set_current(self, stream: CpuStream) -> None:
        self.current = stream
        if self._tls is not None:
            # vllm.utils.torch_utils.current_stream() reads this.
            self._tls.value = stream

    # Replacements for torch.cuda / current_platform functions.

    def current_stream(self, device: Any = None) -> CpuStream:
        return self.current

    def default_stream(self, device: Any = None) -> CpuStream:
        return self.default

    def set_stream(self, stream: CpuStream) -> None:
        self.set_current(stream)

    def synchronize(self, device: Any = None) -> None:
        return None

    @contextlib.contextmanager
    def stream(self, stream: CpuStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        previous = self.current
        self.set_current(stream)
        try:
            yield
        finally:
            self.set_current(previous)


# --------------------------------------------------------------------------
# Model Runner V2's ActiveKVConnector on CPU
# --------------------------------------------------------------------------


def rank0_groups(monkeypatch: Any) -> None:
    """TP and PP groups of a single worker, as the wiring reads them."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    group = SimpleNamespace(rank_in_group=0, world_size=1)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group)


def make_active_env(
    model_dir: str,
    kv_connector: str,
    extra_config: dict[str, Any],
    monkeypatch: Any,
    transfer_results: Any = None,
) -> SimpleNamespace:
    """A single-worker engine's pieces around a real ActiveKVConnector.

    Returns vllm_config, kv_cache_config, caches (seeded), connector, active
    and empty_output (a scheduler's first, empty SchedulerOutput). With
    `transfer_results`, the connector reports them at every
    `get_transfer_results`, set before the wiring wraps the connector.
    """
    vllm_config = make_vllm_config(
        model_dir, kv_connector=kv_connector, extra_config=extra_config
    )
    kv_cache_config = make_kv_cache_config(vllm_config, pp_rank=0)
    caches = make_kv_caches(kv_cache_config, seed=7)
    connector = KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    if transfer_results is not None:
        connector.get_transfer_results = (  # type: ignore[method-assign]
            lambda finished_req_ids: transfer_results
        )
    active = make_active_connector(
        vllm_config, kv_cache_config, connector, caches, monkeypatch
    )
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    return SimpleNamespace(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        caches=caches,
        connector=connector,
        active=active,
        empty_output=scheduler.schedule(),
    )


def make_active_connector(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    connector: KVConnectorBase_V1,
    kv_caches: dict[str, torch.Tensor],
    monkeypatch: Any,
) -> Any:
    """Model Runner V2's connector as `GPUModelRunner.initialize_kv_cache`
    builds it: the worker agent is the global one, the KVCacheConfig is the
    wiring's context variable (set as the initialize_kv_cache hook sets it)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.gpu import kv_connector as gpu_kv_connector

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    if native_kv_checksums():  # the series passes the KVCacheConfig itself
        active = gpu_kv_connector.get_kv_connector(  # type: ignore[call-arg]
            vllm_config, kv_caches, kv_cache_config
        )
    else:
        from vllm.distributed.kv_transfer.kv_checksum import wiring

        token = wiring._kv_cache_config.set(kv_cache_config)
        try:
            active = gpu_kv_connector.get_kv_connector(vllm_config, kv_caches)
        finally:
            wiring._kv_cache_config.reset(token)
    assert isinstance(active, gpu_kv_connector.ActiveKVConnector)
    assert active.kv_connector is connector
    return active


@contextlib.contextmanager
def cpu_cuda_streams(monkeypatch: Any) -> Iterator[CpuStreamState]:
    """The ``cuda_stream_stubs`` fixture's stand-ins (its docstring says
    what is patched), for code outside pytest too (the demo,
    examples/disaggregated/kv_checksum_pd_demo.py, and the host-step
    benchmarks): ``monkeypatch`` is a ``pytest.MonkeyPatch``, which undoes
    them; the platform's attributes are undone on exit. The one set of
    stand-ins: test_kv_checksum_stream_stand_ins.py checks it covers every
    stream and event call the package makes."""
    import vllm.utils.torch_utils as torch_utils
    from vllm.platforms import current_platform

    tls = torch_utils._current_stream_tls
    monkeypatch.setattr(tls, "value", None, raising=False)
    state = CpuStreamState(tls)
    state.set_current(state.default)
    monkeypatch.setattr(CpuStreamState, "_active", state)
    replacements = {
        "Stream": CpuStream,
        "Event": CpuEvent,
        "current_stream": state.current_stream,
        "default_stream": state.default_stream,
        "set_stream": state.set_stream,
        "stream": state.stream,
        "synchronize": state.synchronize,
    }
    for name, replacement in replacements.items():
        monkeypatch.setattr(torch.cuda, name, replacement)
    monkeypatch.setattr(torch_utils, "current_stream", state.current_stream)
    # Platform.__getattr__ answers every missing name (None when torch has no
    # such device module), so monkeypatch would restore a shadowing None:
    # set and remove instance attributes by hand instead.
    platform_attrs = vars(current_platform)
    saved = {
        name: platform_attrs[name] for name in replacements if name in platform_attrs
    }
    try:
        for name, replacement in replacements.items():
            setattr(current_platform, name, replacement)
        yield state
    finally:
        for name in replacements:
            if name in saved:
                setattr(current_platform, name, saved[name])
            else:
                platform_attrs.pop(name, None)
