# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TP split descriptions of Mamba / linear-attention states (R44, R45).

`MambaStateSplit(axis, segments)` names the local axis TP shards in a state
and its run of (local size, replicas) segments. The calculators sit beside
vLLM's state shape functions (`MambaStateShapeCalculator`) and take the same
arguments; they return None, never raise, for sizes TP does not divide. vLLM's
layers return their result from `MambaBase.get_state_splits` into
`MambaSpec.state_splits`; on vLLM 0.33.0, which lacks the field, the plugin
sets it on each layer's spec (wiring/mamba_layers.py). Deriving segments
from `MambaSpec.shapes` is rejected (it cannot tell sharded from replicated
B/C), as is reading group counts from model configs (per-model names).
"""

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec

# The MambaSpec field (R44); on vLLM 0.33.0 an instance attribute the plugin sets.
STATE_SPLITS_ATTR = "state_splits"

Segment = tuple[int, int]  # (local size, replicas R)


@dataclass(frozen=True)
class MambaStateSplit:
    """The local axis TP shards in one state, and its run of segments (R44).

    Each segment is (local size, replicas): a segment with local size l and
    replicas R has l * TP / R global rows; consecutive groups of R ranks hold
    the same rows (R = TP: every rank holds the whole segment).
    """

    axis: int
    segments: tuple[Segment, ...]


StateSplits = tuple[MambaStateSplit, ...]


def _shard(size: int, tp_size: int) -> int | None:
    """The share of one TP rank, or None when TP does not divide `size` (or
    sizes are not positive)."""
    if tp_size < 1 or size < 1 or size % tp_size != 0:
        return None
    return size // tp_size


def _conv_axis(conv_dim_first: bool) -> int:
    """The conv state's TP axis: 0 for (dim, state_len), 1 for (state_len, dim)."""
    return 0 if conv_dim_first else 1


def mamba1_state_splits(
    tp_size: int, intermediate_size: int, conv_dim_first: bool
) -> StateSplits | None:
    """Mamba1: conv [x], temporal [channels] (R44)."""
    local = _shard(intermediate_size, tp_size)
    if local is None:
        return None
    return (
        MambaStateSplit(_conv_axis(conv_dim_first), ((local, 1),)),
        MambaStateSplit(0, ((local, 1),)),
    )


def mamba2_state_splits(
    tp_size: int,
    intermediate_size: int,
    n_groups: int,
    num_heads: int,
    state_size: int,
    conv_dim_first: bool,
) -> StateSplits | None:
    """Mamba2: conv [x, B, C], temporal [heads] (R40, R44).

    `n_groups` is the checkpoint's group count. With n_groups = 1 and TP > 1
    vLLM pads the groups to TP so every rank holds the same B and C: those
    segments have R = TP. Other counts TP does not divide: None.
    """
    if tp_size < 1 or n_groups < 1:
        return None
    if n_groups % tp_size == 0:
        padded, replicas = n_groups, 1
    elif n_groups == 1:
        padded, replicas = tp_size, tp_size
    else:
        return None
    x = _shard(intermediate_size, tp_size)
    bc = _shard(padded * state_size, tp_size)
    heads = _shard(num_heads, tp_size)
    if x is None or bc is None or heads is None:
        return None
    return (
        MambaStateSplit(
            _conv_axis(conv_dim_first), ((x, 1), (bc, replicas), (bc, replicas))
        ),
        MambaStateSplit(0, ((heads, 1),)),
    )


def gdn_state_splits(
    tp_size: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_dim_first: bool,
) -> StateSplits | None:
    """Gated DeltaNet: conv [Q, K, V], temporal [value heads] (R44)."""
    key = _shard(head_k_dim * num_k_heads, tp_size)
    value = _shard(head_v_dim * num_v_heads, tp_size)
    heads = _shard(num_v_heads, tp_size)
    if key is None or value is None or heads is None:
        return None
    return (
        MambaStateSplit(_conv_axis(conv_dim_first), ((key, 1), (key, 1), (value, 1))),
        MambaStateSplit(0, ((heads, 1),)),
    )


def state_splits_of(spec: MambaSpec) -> StateSplits | None:
    """The split description attached to a MambaSpec, None if absent (R44)."""
    return getattr(spec, STATE_SPLITS_ATTR, None)


def attach_state_splits(spec: object, splits: StateSplits | None) -> None:
    """Set `state_splits` on a (frozen) MambaSpec; None leaves it absent.

    A plain instance attribute: pickling and deep copies keep it (the engine
    core's group specs are deep copies of the workers' layer specs);
    `dataclasses.replace` drops it, which leaves the layer unsplit on every
    side alike (equal-TP comparison only, R85).
    """
    if splits is not None and isinstance(spec, MambaSpec):
        object.__setattr__(spec, STATE_SPLITS_ATTR, tuple(splits))


def is_tp_comparable(spec: MambaSpec) -> bool:
    """Whether a Mamba group's checksums compare across TP sizes (R85)."""
    return state_splits_of(spec) is not None or bool(spec.tp_replicated)
