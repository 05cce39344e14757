# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which caches of a worker a KV cache group's checksums cover, and how (R28-R35).

`plan_group_views` turns one group's per-layer caches into checksum views:
8-byte piece views without copy, each with its global first slice and replica
key, or a reason why the group cannot be checksummed on this worker.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    MAX_KV_HEADS_PER_LAYER,
    ReplicaKey,
    sum_fingerprints,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)

PIECE_BYTES = 8


class UncoveredGroup(Exception):
    """A group this worker cannot checksum; the message is the logged reason."""


@dataclass(frozen=True)
class WorkerTopology:
    """The worker's place in the engine and the model facts numbering needs."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    num_blocks: int
    # The model's KV head count when every attention layer shares it, else None.
    uniform_model_kv_heads: int | None
    device: torch.device


@dataclass(frozen=True)
class ChecksumView:
    """One distinct cache of a group as 8-byte pieces, with its global numbering."""

    layer_name: str
    # [num_blocks, kernel_blocks, heads, tokens, pieces] int64 view, no copy
    pieces: torch.Tensor
    first_slice: int
    replica_key: ReplicaKey


@dataclass(frozen=True)
class GroupViews:
    """A checksummable group: its views and this worker's fingerprint (R42)."""

    group_id: int
    block_size: int
    views: tuple[ChecksumView, ...]
    fingerprint: int


def layer_module(layer_name: str) -> str | None:
    """The name up to and including its first all-digit component (R30)."""
    parts = layer_name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def layer_number(layer_name: str) -> int:
    """The layer number vLLM gives a layer name (R30), else UncoveredGroup (R34 d)."""
    try:
        return extract_layer_index(layer_name)
    except (AssertionError, ValueError) as e:
        raise UncoveredGroup(f"layer {layer_name} has no single layer number") from e


def layer_spec(group: KVCacheGroupSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer, also inside mixed-spec groups."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def attention_replicas(spec: AttentionSpec, topo: WorkerTopology) -> int:
    """Consecutive TP ranks holding the same heads of this cache (R32)."""
    tp = topo.tp_size
    if spec.max_tp_shards is not None:
        return max(1, tp // spec.max_tp_shards)
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        return tp
    if spec.num_kv_heads > 1 or tp == 1:
        return 1
    model_heads = topo.uniform_model_kv_heads
    if model_heads is not None and model_heads > 0 and tp % model_heads == 0:
        return tp // model_heads
    raise UncoveredGroup("the TP replication of its KV heads is unknown")


def piece_view(
    cache: torch.Tensor, spec: AttentionSpec, num_blocks: int
) -> torch.Tensor:
    """A [blocks, kernel_blocks, heads, tokens, pieces] int64 view, never a copy."""
    if cache.dim() != 4 or cache.shape[0] % num_blocks != 0:
        raise UncoveredGroup("a cache is not 4-D or not a multiple of the blocks")
    kernel_blocks = cache.shape[0] // num_blocks
    if cache.shape[2] * kernel_blocks != spec.block_size:
        raise UncoveredGroup("kernel blocks do not tile the block size")
    try:
        as_bytes = cache.view(torch.int8)
        pieces = as_bytes.view(torch.int64)
    except RuntimeError as e:
        raise UncoveredGroup("cells or strides are not whole 8-byte pieces") from e
    if as_bytes.shape[-1] % PIECE_BYTES != 0:
        raise UncoveredGroup("cells or strides are not whole 8-byte pieces")
    return pieces.unflatten(0, (num_blocks, kernel_blocks))


def chunk_pieces(pieces: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """A block view split into views of `chunk` consecutive tokens (R135).

    View i holds the block's tokens [i * chunk, (i + 1) * chunk), still as
    [blocks, kernel_blocks, heads, tokens, pieces] and without copy: tokens of
    one kernel block, or whole kernel blocks. Raises if neither tiles.
    """
    kernel_blocks, tokens = pieces.shape[1], pieces.shape[3]
    count = kernel_blocks * tokens // chunk
    if count <= 1:
        return [pieces]
    if tokens % chunk == 0:
        # Chunk i lies in kernel block kb at token t of it.
        return [
            pieces[:, kb : kb + 1, :, t : t + chunk]
            for kb, t in (divmod(i * chunk, tokens) for i in range(count))
        ]
    if chunk % tokens == 0:
        per = chunk // tokens
        return [pieces[:, i * per : (i + 1) * per] for i in range(count)]
    raise UncoveredGroup(
        f"kernel blocks of {tokens} tokens do not tile checksum chunks of "
        f"{chunk} tokens"
    )


def _check_attention_spec(spec: KVCacheSpec) -> AttentionSpec:
    if isinstance(spec, MambaSpec):  # Mamba groups: see mamba.plan_mamba_views
        raise UncoveredGroup("a Mamba layer is in a mixed-spec group")
    if not isinstance(spec, AttentionSpec) or not spec.has_layer_views:
        raise UncoveredGroup("its spec has no per-token KV blocks")
    if spec.tokens_per_state != 1:
        raise UncoveredGroup("its cache is compressed (tokens_per_state != 1)")
    if spec.num_head_slots is not None:
        raise UncoveredGroup("its heads are packed into head slots")
    return spec


def _distinct_caches(
    layer_names: list[str], kv_caches: Mapping[str, torch.Tensor]
) -> dict[tuple, list[str]]:
    """Layers grouped by the cache they use; KV-sharing aliases share one (R29)."""
    caches: dict[tuple, list[str]] = {}
    for name in layer_names:
        cache = kv_caches.get(name)
        if cache is None:
            raise UncoveredGroup(f"layer {name} has no KV cache on this worker")
        key = (cache.data_ptr(), tuple(cache.stride()), tuple(cache.shape))
        caches.setdefault(key, []).append(name)
    return caches


def plan_group_views(
    group_id: int,
    group: KVCacheGroupSpec,
    layer_names: list[str],
    kv_caches: Mapping[str, torch.Tensor],
    topo: WorkerTopology,
) -> GroupViews:
    """Checksum views of one group (drafter layers already removed), or raise."""
    if group.host_resident:
        raise UncoveredGroup("its KV is host-resident")
    specs = {name: layer_spec(group, name) for name in layer_names}
    mixed = isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    if mixed and any(isinstance(s, MambaSpec) for s in specs.values()):
        raise UncoveredGroup("a Mamba layer is in a mixed-spec group")
    attention = {name: _check_attention_spec(spec) for name, spec in specs.items()}
    fingerprint = sum_fingerprints(
        [
            (name, type(spec).__name__, str(spec.dtype))
            for name, spec in attention.items()
        ]
    )

    # One view per distinct cache, under its lowest (layer number, name) user.
    owners: dict[str, str] = {}
    for names in _distinct_caches(layer_names, kv_caches).values():
        owner = min(names, key=lambda n: (layer_number(n), n))
        owners[owner] = owner

    # Caches grouped by module; one layer number may belong to one module only.
    modules: dict[str, list[str]] = {}
    module_of_number: dict[int, str] = {}
    for name in owners:
        module = layer_module(name)
        number = layer_number(name)
        assert module is not None
        if module_of_number.setdefault(number, module) != module:
            raise UncoveredGroup(f"layer number {number} is used by two modules")
        modules.setdefault(module, []).append(name)

    views: list[ChecksumView] = []
    for names in modules.values():
        number = layer_number(names[0])
        first_head = 0
        for name in sorted(names):
            spec = attention[name]
            replicas = attention_replicas(spec, topo)
            heads = kv_caches[name].shape[1]
            if heads != spec.num_kv_heads:
                raise UncoveredGroup("a cache's heads differ from its spec")
            shard, replica = divmod(topo.tp_rank, replicas)
            global_heads = heads * topo.tp_size // replicas
            if first_head + global_heads > MAX_KV_HEADS_PER_LAYER:
                raise UncoveredGroup(
                    f"a layer has more than {MAX_KV_HEADS_PER_LAYER} KV heads"
                )
            views.append(
                ChecksumView(
                    layer_name=name,
                    pieces=piece_view(kv_caches[name], spec, topo.num_blocks),
                    first_slice=number * MAX_KV_HEADS_PER_LAYER
                    + first_head
                    + shard * heads,
                    replica_key=(replicas, replica),
                )
            )
            first_head += global_heads
    block_size = next(iter(attention.values())).block_size
    return GroupViews(group_id, block_size, tuple(views), fingerprint)
