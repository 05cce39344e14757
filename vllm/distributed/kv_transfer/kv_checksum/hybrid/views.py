# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba / linear-attention state coverage: the views of a Mamba group (R36-R43).

A Mamba page packs its states (conv, ssm, extras) from its start; only the
first two (or the only one) are covered, as NIXL transfers exactly those (R36).

- With `state_splits` (one `MambaStateSplit` per covered state, attached to
  the layer's MambaSpec by the plugin): one view per segment, rows numbered
  globally in TP = 1 order, segment after segment, so producer and consumer
  at different TP sizes sum to the same value (R38-R40).
- Without: the covered bytes are one slice of 8-byte pieces, comparable only
  at equal TP or when every rank holds the whole state (R37, R85).

The split descriptions come from :mod:`.mamba_splits`.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    MAX_KV_HEADS_PER_LAYER,
    sum_fingerprints,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import (
    PIECE_BYTES,
    ChecksumView,
    GroupViews,
    UncoveredGroup,
    WorkerTopology,
    layer_module,
    layer_number,
)
from vllm.distributed.kv_transfer.kv_checksum.hybrid.splits import (
    StateSplits,
    state_splits_of,
)
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

# Element dtypes of split rows: unsigned 2- or 4-byte integers (R21).
_ELEMENT_DTYPES = {2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class _CoveredState:
    """One covered state of a page: byte offset, byte count, shape, dtype."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def covered_states(spec: MambaSpec) -> list[_CoveredState]:
    """The first two states (or the only one) of a page, in page order (R36)."""
    states = []
    offset = 0
    for shape, dtype in list(zip(spec.shapes, spec.dtypes))[:2]:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        states.append(_CoveredState(offset, nbytes, tuple(shape), dtype))
        offset += nbytes
    return states


def _pages(
    cache: torch.Tensor, num_blocks: int, states: list[_CoveredState]
) -> torch.Tensor:
    """The [blocks, page bytes] int8 view of a Mamba cache `[B, 1, 1, bytes]`."""
    if cache.dim() != 4 or cache.shape[0] != num_blocks or cache.shape[1:3] != (1, 1):
        raise UncoveredGroup("a Mamba cache is not one page per block")
    covered = states[-1].offset + states[-1].nbytes if states else 0
    if cache.shape[3] < covered:
        raise UncoveredGroup("a Mamba page is smaller than its states")
    return cache.view(torch.int8)[:, 0, 0, :]


def _unsplit_view(pages: torch.Tensor, covered: int) -> torch.Tensor:
    """The covered bytes as one slice of 8-byte pieces: [B, 1, 1, 1, P] (R37)."""
    if covered % PIECE_BYTES != 0:
        raise UncoveredGroup("unsplit Mamba states are not whole 8-byte pieces")
    try:
        pieces = pages[:, :covered].view(torch.int64)
    except RuntimeError as e:
        raise UncoveredGroup("unsplit Mamba states are not whole 8-byte pieces") from e
    return pieces[:, None, None, None, :]


def _row_matrix(pages: torch.Tensor, state: _CoveredState, axis: int) -> torch.Tensor:
    """A state as [B, rows, elements] without copy: the split axis first (R38)."""
    size = torch.empty((), dtype=state.dtype).element_size()
    element = _ELEMENT_DTYPES.get(size)
    if element is None:
        raise UncoveredGroup(
            "split Mamba states have elements of neither 2 nor 4 bytes"
        )
    if not 0 <= axis < len(state.shape):
        raise UncoveredGroup("Mamba state splits do not match the states")
    try:
        raw = pages[:, state.offset : state.offset + state.nbytes].view(element)
        moved = raw.view(-1, *state.shape).movedim(axis + 1, 1)
        return moved.view(moved.shape[0], moved.shape[1], -1)
    except RuntimeError as e:
        raise UncoveredGroup(
            "Mamba states are not viewable by rows without copy"
        ) from e


def _split_identity(
    spec: MambaSpec, splits: StateSplits, tp_size: int
) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], list[str]]:
    """(global segment sizes, other dimensions) per split state and dtypes (R42)."""
    shapes = []
    for split, state in zip(splits, covered_states(spec)):
        sizes = tuple(size * tp_size // r for size, r in split.segments)
        others = tuple(d for i, d in enumerate(state.shape) if i != split.axis)
        shapes.append((sizes, others))
    return shapes, [str(s.dtype) for s in covered_states(spec)]


def mamba_layer_identity(name: str, spec: MambaSpec, tp_size: int) -> tuple:
    """The fingerprint identity of a Mamba layer (R42): equal for every TP size
    and conv layout with splits; local shapes and dtypes without."""
    splits = state_splits_of(spec)
    if splits is not None:
        shapes, dtypes = _split_identity(spec, splits, tp_size)
        return (name, "MambaSpec", shapes, dtypes)
    states = covered_states(spec)
    return (
        name,
        "MambaSpec",
        [s.shape for s in states],
        [str(s.dtype) for s in states],
    )


def _check_splits(
    splits: StateSplits, states: list[_CoveredState], tp_size: int
) -> None:
    """Splits must describe every covered state and partition its split axis."""
    if len(splits) != len(states):
        raise UncoveredGroup("Mamba state splits do not match the states")
    for split, state in zip(splits, states):
        if (
            not 0 <= split.axis < len(state.shape)
            or sum(size for size, _ in split.segments) != state.shape[split.axis]
        ):
            raise UncoveredGroup("Mamba state splits do not match the states")
        if any(r < 1 or tp_size % r != 0 for _, r in split.segments):
            raise UncoveredGroup("Mamba state splits do not match the states")


def _split_views(
    name: str,
    pages: torch.Tensor,
    states: list[_CoveredState],
    splits: StateSplits,
    topo: WorkerTopology,
    first_row: int,
) -> tuple[list[ChecksumView], int]:
    """One [B, 1, rows, 1, elements] view per segment, rows global (R38-R40).

    Returns the views and the number of global rows they number.
    """
    number = layer_number(name)
    tp, rank = topo.tp_size, topo.tp_rank
    views: list[ChecksumView] = []
    row_base = first_row
    for split, state in zip(splits, states):
        matrix = _row_matrix(pages, state, split.axis)
        local = 0
        for size, replicas in split.segments:
            rows = matrix[:, local : local + size, :]
            views.append(
                ChecksumView(
                    layer_name=name,
                    pieces=rows[:, None, :, None, :],
                    first_slice=number * MAX_KV_HEADS_PER_LAYER
                    + row_base
                    + (rank // replicas) * size,
                    replica_key=(replicas, rank % replicas),
                )
            )
            local += size
            row_base += size * tp // replicas
    return views, row_base - first_row


def plan_mamba_views(
    group_id: int,
    group: KVCacheGroupSpec,
    layer_names: list[str],
    kv_caches: Mapping[str, torch.Tensor],
    topo: WorkerTopology,
) -> GroupViews:
    """Checksum views of a Mamba group (drafter layers already removed), or raise.

    The group's block size is 1: one state per block, at position 0 (R67, R88).
    """
    spec = group.kv_cache_spec
    assert isinstance(spec, MambaSpec)
    if group.host_resident:
        raise UncoveredGroup("its KV is host-resident")
    states = covered_states(spec)
    splits = state_splits_of(spec)
    if splits is not None:
        _check_splits(splits, states, topo.tp_size)
    covered = states[-1].offset + states[-1].nbytes if states else 0
    views: list[ChecksumView] = []
    seen: dict[tuple, str] = {}
    next_row: dict[str, int] = {}
    for name in sorted(layer_names, key=lambda n: (layer_number(n), n)):
        cache = kv_caches.get(name)
        if cache is None:
            raise UncoveredGroup(f"layer {name} has no KV cache on this worker")
        key = (cache.data_ptr(), tuple(cache.stride()), tuple(cache.shape))
        if key in seen:
            continue  # a KV-sharing alias: counted once (R29)
        seen[key] = name
        module = layer_module(name) or name
        first = next_row.get(module, 0)
        pages = _pages(cache, topo.num_blocks, states)
        if splits is not None:
            layer_views, rows = _split_views(name, pages, states, splits, topo, first)
        else:
            replicas = topo.tp_size if spec.tp_replicated else 1
            shard, replica = divmod(topo.tp_rank, replicas)
            layer_views = [
                ChecksumView(
                    layer_name=name,
                    pieces=_unsplit_view(pages, covered),
                    first_slice=layer_number(name) * MAX_KV_HEADS_PER_LAYER
                    + first
                    + shard,
                    replica_key=(replicas, replica),
                )
            ]
            rows = topo.tp_size // replicas
        if first + rows > MAX_KV_HEADS_PER_LAYER:
            raise UncoveredGroup(
                f"a layer has more than {MAX_KV_HEADS_PER_LAYER} KV heads"
            )
        next_row[module] = first + rows
        views.extend(layer_views)
    fingerprint = sum_fingerprints(
        [mamba_layer_identity(name, spec, topo.tp_size) for name in layer_names]
    )
    return GroupViews(group_id, 1, tuple(views), fingerprint)
