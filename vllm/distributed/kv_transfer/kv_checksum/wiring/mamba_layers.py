# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the Mamba and GDN layers' get_kv_cache_spec (R44, R85); the logic
is in hybrid/splits.py.

Hooks (target; why; how; the upstream change that lets it go):

get_kv_cache_spec of MambaMixer, MambaMixer2, QwenGatedDeltaNetAttention,
  OlmoHybridGatedDeltaNetAttention
    Why: the worker numbers split Mamba rows globally; the scheduler must know a
    group compares across TP
    How: after the original, the splits set on the spec as an instance attribute
    Upstream: `MambaSpec.state_splits` filled from `MambaBase.get_state_splits()`
"""

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.hybrid import splits as mamba_splits
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _enabled,
    _wrap,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def _mamba1_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    return mamba_splits.mamba1_state_splits(tp_size, layer.intermediate_size, dim_first)


def _mamba2_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    """vLLM pads one group to TP groups (`layer.n_groups` is the padded count)
    and then builds conv1d as a plain ColumnParallelLinear: the checkpoint's
    group count was 1."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    one_group = tp_size > 1 and not isinstance(layer.conv1d, MergedColumnParallelLinear)
    return mamba_splits.mamba2_state_splits(
        tp_size,
        layer.intermediate_size,
        1 if one_group else layer.n_groups,
        layer.num_heads,
        layer.ssm_state_size,
        dim_first,
    )


def _gdn_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    return mamba_splits.gdn_state_splits(
        tp_size,
        layer.num_k_heads,
        layer.num_v_heads,
        layer.head_k_dim,
        layer.head_v_dim,
        dim_first,
    )


# (module, class, layer -> splits): the layers R44 names.
_MAMBA_SPLIT_LAYERS = (
    ("vllm.model_executor.layers.mamba.mamba_mixer", "MambaMixer", _mamba1_splits),
    ("vllm.model_executor.layers.mamba.mamba_mixer2", "MambaMixer2", _mamba2_splits),
    (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        "QwenGatedDeltaNetAttention",
        _gdn_splits,
    ),
    (
        "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn",
        "OlmoHybridGatedDeltaNetAttention",
        _gdn_splits,
    ),
)


def install_mamba_split_hooks() -> None:
    import importlib

    for module_name, class_name, calculator in _MAMBA_SPLIT_LAYERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception:  # a layer this vLLM build lacks: nothing to describe
            logger.debug("KV checksums: no %s.%s", module_name, class_name)
            continue
        _wrap_mamba_spec(cls, calculator)


def _wrap_mamba_spec(cls: type, calculator: Callable[[Any, int, bool], Any]) -> None:
    @_wrap(cls, "get_kv_cache_spec")
    def get_kv_cache_spec(original: Callable, self: Any, vllm_config: Any) -> Any:
        """R44. Target: get_kv_cache_spec of MambaMixer, MambaMixer2 and the
        Qwen and Olmo GDN layers (inherited from MambaBase).

        Why: the worker numbers split Mamba rows globally and the scheduler
        must know a group is comparable across TP sizes (R85); vLLM 0.33.0's
        MambaSpec has no `state_splits` field.
        How: after the original, the calculator's result (None for sizes TP
        does not divide) is set on the returned spec as an instance
        attribute, which survives pickling to the engine core and its deep
        copies into group specs. Disabled: the original's spec untouched;
        an error leaves the spec without splits (equal-TP comparison only).
        Upstream: `MambaSpec.state_splits` (default None) filled from a
        `MambaBase.get_state_splits()` (default None) in get_kv_cache_spec.
        """
        spec = original(self, vllm_config)
        if spec is None or not _enabled(vllm_config, "get_kv_cache_spec"):
            return spec
        try:
            from vllm.model_executor.layers.mamba.mamba_utils import (
                is_conv_state_dim_first,
            )

            tp_size = vllm_config.parallel_config.tensor_parallel_size
            splits = calculator(self, tp_size, is_conv_state_dim_first())
            mamba_splits.attach_state_splits(spec, splits)
        except Exception:
            logger.exception(
                "KV checksums: no TP splits for %s; its Mamba state verifies "
                "at equal TP only.",
                type(self).__name__,
            )
        return spec
