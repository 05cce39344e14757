# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba / GDN state checksums with TP splits (R36-R45, R67, R85).

State shapes and dtypes come from vLLM 0.33.0's own shape functions
(`MambaStateShapeCalculator`), the specs are real `MambaSpec`s and the caches
come from vLLM's `allocate_kv_cache` (padded pages, layers interleaved as in a
hybrid allocation). Layer modules are not built: MambaMixer2 and the GDN layers
need an initialized TP group of the TP size under test, which one CPU process
cannot have for TP 2; the plugin hook that attaches the split description is
tested on the real classes' `get_kv_cache_spec` (see the last tests).

Truth is a global (TP = 1) state per layer, written into each rank's pages the
way vLLM shards it; an independent NumPy reference below numbers global rows
(segment after segment: Mamba1 conv x then channels; Mamba2 conv x, B, C then
heads; GDN conv Q, K, V then value heads) and computes R21/R137 without any
package function. Mamba2 runs with one group (B/C replicated on every rank,
R40) and with two (B/C sharded at TP 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import build_kv_cache_tensors
from tests.v1.kv_connector.unit.kv_checksum_reference import mix64
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    KVChecksumWorker,
    WorkerTopology,
)
from vllm.distributed.kv_transfer.kv_checksum.hybrid import splits as mamba_splits
from vllm.distributed.kv_transfer.kv_checksum.hybrid.views import mamba_layer_identity
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumStatus,
    KVChecksumWorkerReport,
    build_producer_payload,
    verify_load,
)
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateShapeCalculator as Shapes,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

pytestmark = pytest.mark.cpu

H = 1 << 16
U64 = np.uint64
NUM_BLOCKS = 8
NUM_TOKENS = 100
CONV_KERNEL = 4
PAGE = 4096  # padded page, as the platform pads Mamba pages to attention's
GROUPS = {0: [0, 2], 1: [1, 3]}  # two Mamba groups of two layers each


# --------------------------------------------------------------------------
# Model families: global sizes of each segment (TP = 1 order) and shapes
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """A tiny model's Mamba layer, global sizes, and vLLM's shapes per TP."""

    name: str
    # conv segments: (global channels, replicated on every rank?)
    conv: tuple[tuple[int, bool], ...]
    # temporal state: global heads and the per-head shape
    heads: int
    head_shape: tuple[int, ...]
    args: dict

    def shapes(self, tp: int, dim_first: bool) -> tuple[tuple[int, ...], ...]:
        """vLLM's state shapes at this TP size and conv layout."""
        with _conv_layout(dim_first):
            if self.name == "mamba1":
                return Shapes.mamba1_state_shape(tp_world_size=tp, **self.args)
            if self.name == "mamba2":
                return Shapes.mamba2_state_shape(tp_world_size=tp, **self.args)
            return Shapes.gated_delta_net_state_shape(tp, **self.args)

    def splits(self, tp: int, dim_first: bool) -> Any:
        a = self.args
        if self.name == "mamba1":
            return mamba_splits.mamba1_state_splits(
                tp, a["intermediate_size"], dim_first
            )
        if self.name == "mamba2":
            return mamba_splits.mamba2_state_splits(
                tp,
                a["intermediate_size"],
                a["n_groups"],
                a["num_heads"],
                a["state_size"],
                dim_first,
            )
        return mamba_splits.gdn_state_splits(
            tp,
            a["num_k_heads"],
            a["num_v_heads"],
            a["head_k_dim"],
            a["head_v_dim"],
            dim_first,
        )


def mamba2(n_groups: int) -> Family:
    i, s, heads, head_dim = 64, 4, 8, 8
    bc = n_groups * s
    args = dict(
        intermediate_size=i,
        n_groups=n_groups,
        num_heads=heads,
        head_dim=head_dim,
        state_size=s,
        conv_kernel=CONV_KERNEL,
    )
    one = n_groups == 1
    return Family(
        "mamba2", ((i, False), (bc, one), (bc, one)), heads, (head_dim, s), args
    )


def mamba1() -> Family:
    i, s = 32, 4
    args = dict(intermediate_size=i, state_size=s, conv_kernel=CONV_KERNEL)
    return Family("mamba1", ((i, False),), i, (s,), args)


def gdn() -> Family:
    kh, vh, kd, vd = 2, 4, 8, 8
    args = dict(
        num_k_heads=kh,
        num_v_heads=vh,
        head_k_dim=kd,
        head_v_dim=vd,
        conv_kernel_size=CONV_KERNEL,
    )
    conv = ((kh * kd, False), (kh * kd, False), (vh * vd, False))
    return Family("gdn", conv, vh, (vd, kd), args)


FAMILIES = {
    "mamba1": mamba1(),
    "mamba2_g1": mamba2(1),
    "mamba2_g2": mamba2(2),
    "gdn": gdn(),
}


# --------------------------------------------------------------------------
# Independent reference (no package code)
# --------------------------------------------------------------------------


@dataclasses.dataclass
class GlobalState:
    """One layer's global state: conv rows per segment and temporal heads."""

    conv: list[np.ndarray]  # per segment uint16 [channels, CONV_KERNEL - 1]
    temporal: np.ndarray  # uint32 [heads, *head_shape]


def random_state(rng: np.random.Generator, family: Family) -> GlobalState:
    conv = [
        rng.integers(0, 1 << 16, size=(n, CONV_KERNEL - 1), dtype=np.uint16)
        for n, _ in family.conv
    ]
    temporal = rng.integers(
        0, 1 << 32, size=(family.heads, *family.head_shape), dtype=np.uint32
    )
    return GlobalState(conv, temporal)


def reference_layer_checksum(layer: int, state: GlobalState) -> int:
    """R21/R25/R137: rows numbered globally, conv segments then temporal heads."""
    rows = [r for seg in state.conv for r in seg] + list(
        state.temporal.reshape(state.temporal.shape[0], -1)
    )
    total = U64(0)
    with np.errstate(over="ignore"):
        for g, row in enumerate(rows):
            elements = np.asarray(row, dtype=U64)
            weights = U64(2) * np.arange(elements.size, dtype=U64) + U64(1)
            s = (mix64(elements) * weights).sum(dtype=U64)
            total += (U64(2) * (U64(layer) * U64(H) + U64(g)) + U64(1)) * s
    return int(total)


def local_conv(family: Family, state: GlobalState, tp: int, rank: int) -> np.ndarray:
    """The rank's conv channels as vLLM shards them: each segment's shard
    (a replicated segment whole), segments concatenated."""
    parts = []
    for (n, replicated), seg in zip(family.conv, state.conv):
        if replicated:
            parts.append(seg)
        else:
            size = n // tp
            parts.append(seg[rank * size : (rank + 1) * size])
    return np.concatenate(parts)


def write_page(
    cache: torch.Tensor,
    block: int,
    family: Family,
    state: GlobalState,
    tp: int,
    rank: int,
    dim_first: bool,
) -> None:
    """Write the rank's conv (bf16 bits) then temporal (fp32 bits) states."""
    conv = local_conv(family, state, tp, rank)  # [channels, state_len]
    conv = conv if dim_first else conv.T
    heads = family.heads // tp
    temporal = state.temporal[rank * heads : (rank + 1) * heads]
    data = conv.astype("<u2").tobytes() + temporal.astype("<u4").tobytes()
    page = cache.view(torch.uint8)[block, 0, 0]
    page[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --------------------------------------------------------------------------
# Engines: real specs, vLLM's allocation, real workers
# --------------------------------------------------------------------------


def layer_name(index: int) -> str:
    return f"model.layers.{index}.mixer"


def make_spec(family: Family, tp: int, dim_first: bool, splits: bool) -> MambaSpec:
    spec = MambaSpec(
        block_size=16,
        shapes=family.shapes(tp, dim_first),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE,
        mamba_cache_mode="align",
    )
    if splits:
        mamba_splits.attach_state_splits(spec, family.splits(tp, dim_first))
    return spec


@dataclasses.dataclass
class Rank:
    worker: KVChecksumWorker
    caches: dict[str, torch.Tensor]


def make_ranks(
    family: Family, tp: int, dim_first: bool, splits: bool = True
) -> list[Rank]:
    """One worker per TP rank over vLLM-allocated caches of two Mamba groups."""
    ranks = []
    for rank in range(tp):
        spec = make_spec(family, tp, dim_first, splits)
        groups = [
            KVCacheGroupSpec([layer_name(i) for i in layers], spec)
            for layers in GROUPS.values()
        ]
        tensors = build_kv_cache_tensors(
            groups, NUM_BLOCKS, KVCacheLayout.LBHNC, alias_groups=True
        )
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=tensors,
            kv_cache_groups=groups,
            kv_cache_layout="LBHNC",
        )
        caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
        next(iter(caches.values())).view(torch.uint8).random_(0, 256)
        topo = WorkerTopology(rank, tp, 0, NUM_BLOCKS, None, torch.device("cpu"))
        ranks.append(Rank(KVChecksumWorker(config, caches, topo), caches))
    return ranks


def fill(
    ranks: list[Rank],
    family: Family,
    states: Mapping[int, GlobalState],
    blocks: Mapping[int, int],
    dim_first: bool,
) -> None:
    """Write every layer's global state into its group's block on every rank."""
    tp = len(ranks)
    for gid, layers in GROUPS.items():
        for layer in layers:
            for rank, r in enumerate(ranks):
                cache = r.caches[layer_name(layer)]
                write_page(
                    cache, blocks[gid], family, states[layer], tp, rank, dim_first
                )


def scheduled(blocks: Mapping[int, int]) -> KVChecksumBlocks:
    """Both groups at position 0, one running-state block each (R67)."""
    return KVChecksumBlocks(
        NUM_TOKENS,
        {gid: (0, np.array([block], dtype=np.int64)) for gid, block in blocks.items()},
    )


def reports(
    ranks: list[Rank], blocks: Mapping[int, int], send: bool
) -> dict[tuple[int, int], KVChecksumWorkerReport]:
    out = {}
    for rank, r in enumerate(ranks):
        step = scheduled(blocks)
        if send:
            r.worker.bind(KVChecksumScheduled(reqs_to_send={"req": step}))
            pending = r.worker.post_forward(None)
        else:
            r.worker.bind(KVChecksumScheduled(reqs_to_recv={"req": step}))
            pending = r.worker.post_forward(["req"])
        assert pending is not None
        report = KVChecksumWorkerReport.from_record(pending.finalize(), "req")
        assert report is not None
        out[(0, rank)] = report
    return out


INFOS = {gid: KVChecksumGroupInfo(16, is_mamba=True) for gid in GROUPS}


def verdict_of(
    producer: list[Rank],
    consumer: list[Rank],
    p_blocks: Mapping[int, int],
    c_blocks: Mapping[int, int],
    infos: Mapping[int, KVChecksumGroupInfo] = INFOS,
) -> Any:
    sent = reports(producer, p_blocks, send=True)
    payload = build_producer_payload(
        sent, scheduled(p_blocks), len(producer), len(producer), infos
    )
    assert not isinstance(payload, str), payload
    received = reports(consumer, c_blocks, send=False)
    return verify_load(
        payload,
        None,
        received,
        scheduled(c_blocks),
        len(consumer),
        len(consumer),
        infos,
    )


@pytest.fixture
def world(cuda_stream_stubs: Any) -> Any:
    """Global states of four layers and the blocks each side uses."""
    rng = np.random.default_rng(5)

    def make(family: Family) -> dict[int, GlobalState]:
        return {layer: random_state(rng, family) for layer in range(4)}

    return make


TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]
P_BLOCKS = {0: 3, 1: 5}
C_BLOCKS = {0: 6, 1: 2}


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_sums_equal_independent_reference_r38_r40(
    world: Any, family_name: str, dim_first: bool, tp: int
) -> None:
    """R38-R40, R25: every rank's send values (replica-0 views) sum to the
    reference of the global state, with rows numbered in TP = 1 order.

    Bugs caught: numbering rows per rank (rank 1 restarts at row 0), counting
    B/C once per rank (every rank sending its replica, R40), using the TP = 2
    offsets of a segment for the next one (row base not advanced by the global
    segment size), reading the conv state with the wrong axis as rows.
    """
    family = FAMILIES[family_name]
    if family.splits(tp, dim_first) is None:
        pytest.skip("TP does not divide this model")
    states = world(family)
    ranks = make_ranks(family, tp, dim_first)
    fill(ranks, family, states, P_BLOCKS, dim_first)
    sent = reports(ranks, P_BLOCKS, send=True)
    for gid, layers in GROUPS.items():
        got = 0
        for report in sent.values():
            got += int(report.groups[gid].values.sum(dtype=U64))
        expected = sum(reference_layer_checksum(n, states[n]) for n in layers)
        assert got % (1 << 64) == expected % (1 << 64)


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
@pytest.mark.parametrize("tp_pair", TP_PAIRS)
def test_clean_loads_verify_across_tp_r39_r91(
    world: Any, family_name: str, tp_pair: tuple[int, int]
) -> None:
    """R39, R85, R91: producer TP -> consumer TP 1->1, 1->2, 2->1, 2->2 verify.

    The producer uses SD conv states, the consumer DS (the layout NIXL needs),
    so the layout must not matter either. Bug caught: a fingerprint with local
    shapes (different per TP) would leave the groups unverified.
    """
    family = FAMILIES[family_name]
    states = world(family)
    producer = make_ranks(family, tp_pair[0], dim_first=False)
    consumer = make_ranks(family, tp_pair[1], dim_first=True)
    fill(producer, family, states, P_BLOCKS, dim_first=False)
    fill(consumer, family, states, C_BLOCKS, dim_first=True)
    verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS)
    assert verdict.status == KVChecksumStatus.VERIFIED, verdict.reasons
    assert sorted(verdict.compared_groups) == [0, 1]


def covered_bytes(family: Family, tp: int) -> int:
    shapes = family.shapes(tp, True)
    return int(np.prod(shapes[0])) * 2 + int(np.prod(shapes[1])) * 4


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
@pytest.mark.parametrize("tp_pair", TP_PAIRS)
def test_state_bit_flips_mismatch_at_their_group_r22(
    world: Any, family_name: str, tp_pair: tuple[int, int]
) -> None:
    """R22, R36: a flipped bit in a covered state byte (conv or temporal) of
    any layer on any consumer rank is a mismatch of exactly that layer's group.

    Bytes are drawn so that every (layer, rank, state) combination is hit,
    including the last covered byte. Bugs caught: covering only the first
    state, dropping a segment's view, a replica column left out of the checks
    (a flip in rank 1's copy of B or C would pass).
    """
    family = FAMILIES[family_name]
    states = world(family)
    p_tp, c_tp = tp_pair
    producer = make_ranks(family, p_tp, dim_first=False)
    fill(producer, family, states, P_BLOCKS, dim_first=False)
    consumer = make_ranks(family, c_tp, dim_first=True)
    conv_bytes = int(np.prod(family.shapes(c_tp, True)[0])) * 2
    total = covered_bytes(family, c_tp)
    rng = np.random.default_rng(11)
    for layer in range(4):
        gid = next(g for g, layers in GROUPS.items() if layer in layers)
        for rank in range(c_tp):
            for byte in (
                int(rng.integers(0, conv_bytes)),
                int(rng.integers(conv_bytes, total)),
                total - 1,
            ):
                fill(consumer, family, states, C_BLOCKS, dim_first=True)
                page = consumer[rank].caches[layer_name(layer)].view(torch.uint8)
                page[C_BLOCKS[gid], 0, 0, byte] ^= 1 << int(rng.integers(0, 8))
                verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS)
                assert verdict.status == KVChecksumStatus.MISMATCH, (layer, rank, byte)
                assert verdict.mismatches == {gid: [0]}


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_state_of_another_request_mismatches_r67(world: Any, family_name: str) -> None:
    """R67: a consumer block holding another request's state (a stale or
    wrong block read) mismatches its group, and only that group."""
    family = FAMILIES[family_name]
    states = world(family)
    other = world(family)
    producer = make_ranks(family, 2, dim_first=False)
    consumer = make_ranks(family, 1, dim_first=True)
    fill(producer, family, states, P_BLOCKS, dim_first=False)
    fill(consumer, family, states, C_BLOCKS, dim_first=True)
    assert verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS).status == (
        KVChecksumStatus.VERIFIED
    )
    # Group 1's layers now hold another request's states.
    for layer in GROUPS[1]:
        write_page(
            consumer[0].caches[layer_name(layer)],
            C_BLOCKS[1],
            family,
            other[layer],
            1,
            0,
            True,
        )
    verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS)
    assert verdict.status == KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {1: [0]}


def test_bc_replica_read_at_sharded_offset_mismatches_r40(world: Any) -> None:
    """R40: Mamba2 with one group, producer TP 1 -> consumer TP 2. A transfer
    that reads B and C at sharded offsets (rank 1 takes the producer's B at
    offset S, i.e. C, and C past the conv state, as a 3-read with TP-sharded
    offsets of the padded groups does) must mismatch, in the group of the
    layer whose copy is wrong, although rank 0's copy is right.

    Bug caught: checking only replica 0 of B/C (the consumer summing all
    columns, or the calculator giving B/C R = 1) passes this load.
    """
    family = FAMILIES["mamba2_g1"]
    states = world(family)
    producer = make_ranks(family, 1, dim_first=True)
    consumer = make_ranks(family, 2, dim_first=True)
    fill(producer, family, states, P_BLOCKS, dim_first=True)
    fill(consumer, family, states, C_BLOCKS, dim_first=True)
    layer = 2  # group 0
    bad = dataclasses.replace(states[layer])
    bad.conv = [
        states[layer].conv[0],
        states[layer].conv[2],  # B read at offset S: C's rows
        states[layer].temporal.reshape(-1).view(np.uint16)[: 4 * 3].reshape(4, 3),
    ]
    write_page(
        consumer[1].caches[layer_name(layer)], C_BLOCKS[0], family, bad, 2, 1, True
    )
    verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS)
    assert verdict.status == KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [0]}


def test_unsplit_state_compares_at_equal_tp_only_r37_r85(world: Any) -> None:
    """R37, R85: without splits the covered bytes are one slice per rank;
    equal TP verifies and catches a flip, different TP leaves the group out
    (not compared, no mismatch: the slices are not comparable)."""
    family = FAMILIES["gdn"]
    states = world(family)
    infos = {
        gid: KVChecksumGroupInfo(16, is_mamba=True, tp_comparable=False)
        for gid in GROUPS
    }
    producer = make_ranks(family, 2, dim_first=True, splits=False)
    consumer = make_ranks(family, 2, dim_first=True, splits=False)
    fill(producer, family, states, P_BLOCKS, dim_first=True)
    fill(consumer, family, states, C_BLOCKS, dim_first=True)
    verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS, infos)
    assert verdict.status == KVChecksumStatus.VERIFIED
    consumer[1].caches[layer_name(1)].view(torch.uint8)[C_BLOCKS[1], 0, 0, 7] ^= 4
    verdict = verdict_of(producer, consumer, P_BLOCKS, C_BLOCKS, infos)
    assert verdict.mismatches == {1: [0]}
    single = make_ranks(family, 1, dim_first=True, splits=False)
    fill(single, family, states, C_BLOCKS, dim_first=True)
    verdict = verdict_of(producer, single, P_BLOCKS, C_BLOCKS, infos)
    assert verdict.tp_incomparable_groups == [0, 1]
    assert verdict.status == KVChecksumStatus.UNVERIFIED  # nothing compared


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_split_fingerprints_equal_across_tp_and_layout_r42_r43(
    family_name: str,
) -> None:
    """R42: with splits the identity is equal for TP 1/2 and both conv layouts;
    another conv width (R43: speculative tokens) changes it; without splits
    the local shapes make TP sizes differ."""
    family = FAMILIES[family_name]
    name = layer_name(0)
    ids = {
        repr(mamba_layer_identity(name, make_spec(family, tp, dim_first, True), tp))
        for tp in (1, 2)
        for dim_first in (False, True)
    }
    assert len(ids) == 1
    wider = dataclasses.replace(family, args={**family.args, "conv_kernel": 5})
    if family.name == "gdn":
        wider = dataclasses.replace(family, args={**family.args, "conv_kernel_size": 5})
    assert (
        repr(mamba_layer_identity(name, make_spec(wider, 1, True, True), 1)) not in ids
    )
    unsplit = {
        repr(mamba_layer_identity(name, make_spec(family, tp, True, False), tp))
        for tp in (1, 2)
    }
    assert len(unsplit) == 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_calculators_partition_vllm_shapes_r44(tp: int) -> None:
    """R44: each calculator's segments sum to the split axis of vLLM's own
    shape (both conv layouts), their global sizes do not depend on TP, and
    sizes TP does not divide give None instead of raising."""
    for family in FAMILIES.values():
        if family.splits(tp, dim_first=False) is None:
            continue  # TP does not divide this model: None, no exception
        for dim_first in (False, True):
            splits = family.splits(tp, dim_first)
            shapes = family.shapes(tp, dim_first)
            for split, shape in zip(splits, shapes):
                assert sum(size for size, _ in split.segments) == shape[split.axis]
            globals_ = [
                [size * tp // r for size, r in split.segments] for split in splits
            ]
            base = [
                [size for size, _ in split.segments]
                for split in family.splits(1, dim_first)
            ]
            assert globals_ == base
    assert mamba_splits.mamba2_state_splits(4, 64, 2, 8, 4, True) is None
    assert mamba_splits.mamba2_state_splits(3, 64, 1, 8, 4, True) is None
    assert mamba_splits.gdn_state_splits(3, 2, 4, 8, 8, True) is None
    assert mamba_splits.mamba1_state_splits(0, 64, True) is None


class _conv_layout:
    """Temporarily sets vLLM's conv state layout (DS when dim_first)."""

    def __init__(self, dim_first: bool) -> None:
        self.dim_first = dim_first

    def __enter__(self) -> None:
        from vllm.model_executor.layers.mamba import mamba_utils

        self.saved = mamba_utils.get_conv_state_layout
        layout = "DS" if self.dim_first else "SD"
        mamba_utils.get_conv_state_layout = lambda: layout  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        from vllm.model_executor.layers.mamba import mamba_utils

        mamba_utils.get_conv_state_layout = self.saved  # type: ignore[assignment]


# --------------------------------------------------------------------------
# Scheduler side: which block, and which groups compare across TP
# --------------------------------------------------------------------------


def _blocks(*ids: int) -> list:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return [KVCacheBlock(i, is_null=(i == 0)) for i in ids]


def test_running_state_block_never_scratch_r67() -> None:
    """R67: Mamba groups take the running-state block at position 0, whatever
    the token range: align mode (position-indexed, nulls before, one scratch
    block after) and "none" mode ([running, speculative...]); a group without
    a non-null block is left out. Bugs caught: taking the last block (the
    scratch block), position-based selection like attention groups."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
        SchedulerGroup,
        select_blocks,
    )

    groups = {
        0: SchedulerGroup(16, mamba_spec_blocks=1),
        1: SchedulerGroup(16, mamba_spec_blocks=0),
        2: SchedulerGroup(16, mamba_spec_blocks=2),
        3: SchedulerGroup(16),
    }
    request = [
        _blocks(0, 0, 0, 11, 12),  # align: running state 11, scratch 12
        _blocks(0, 0, 21),  # no speculation: the last non-null block
        _blocks(31, 32, 33),  # "none" mode: [running, spec, spec]
        _blocks(41, 42, 43, 44),  # attention: positions of tokens [32, 50)
    ]
    selected = select_blocks(request, groups, 32, 50)
    assert {g: (s, ids.tolist()) for g, (s, ids) in selected.groups.items()} == {
        0: (0, [11]),
        1: (0, [21]),
        2: (0, [31]),
        3: (2, [43, 44]),
    }
    empty = select_blocks([_blocks(0, 0)], {0: groups[0]}, 0, 20)
    assert empty.groups == {}


def _mamba_config(splits: bool, tp_replicated: bool = False) -> KVCacheConfig:
    spec = dataclasses.replace(
        make_spec(FAMILIES["gdn"], 2, True, False), tp_replicated=tp_replicated
    )
    if splits:
        mamba_splits.attach_state_splits(spec, FAMILIES["gdn"].splits(2, True))
    # vLLM deep-copies layer specs into group specs (KVCacheSpec.merge).
    merged = MambaSpec.merge([spec, spec])
    groups = [KVCacheGroupSpec([layer_name(0), layer_name(1)], merged)]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
    )


@pytest.mark.parametrize(
    ("splits", "replicated", "comparable"),
    [(True, False, True), (False, False, False), (False, True, True)],
)
def test_scheduler_knows_mamba_groups_r85(
    splits: bool, replicated: bool, comparable: bool
) -> None:
    """R85, R88: the scheduler built from a KVCacheConfig marks Mamba groups
    (one state per block) and compares them across TP sizes only with splits
    (kept through vLLM's deep copy into the group spec) or replicated state."""
    import pickle

    from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
        KVChecksumScheduler,
    )

    config = pickle.loads(pickle.dumps(_mamba_config(splits, replicated)))
    kcs = KVChecksumScheduler.create(
        config,
        num_workers=2,
        tp_size=2,
        fail_closed=True,
        carrier=lambda request, receiving: None,
        hit_sources=lambda request, n: set(),
        max_model_len=1024,
        max_payload_bytes=1 << 20,
    )
    info = kcs.group_infos[0]
    assert info.is_mamba and info.chunks_per_block == 1
    assert info.tp_comparable == comparable
    assert kcs.groups[0].mamba_spec_blocks == 0


# --------------------------------------------------------------------------
# The plugin hook on vLLM's real layer classes (R44)
# --------------------------------------------------------------------------


def _mixer2(n_groups: int, tp: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A MambaMixer2 (real class and methods) with the attributes its
    constructor sets at TP `tp`; building one needs a TP group of that size."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
    )
    from vllm.model_executor.layers.mamba import mamba_mixer2

    monkeypatch.setattr(
        mamba_mixer2, "get_tensor_model_parallel_world_size", lambda: tp
    )
    layer = object.__new__(mamba_mixer2.MambaMixer2)
    torch.nn.Module.__init__(layer)
    padded = n_groups if n_groups % tp == 0 else tp
    linear = MergedColumnParallelLinear if n_groups % tp == 0 else ColumnParallelLinear
    layer.conv1d = object.__new__(linear)
    layer.intermediate_size, layer.num_heads, layer.head_dim = 64, 8, 8
    layer.n_groups, layer.ssm_state_size, layer.conv_kernel_size = padded, 4, 4
    layer.num_spec, layer.use_replayssm = 0, False
    layer.get_state_dtype = lambda: (torch.bfloat16, torch.float32)
    return layer


@pytest.mark.kv_checksum_capability("hybrid")
@pytest.mark.parametrize(("n_groups", "tp"), [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_plugin_attaches_mamba2_splits_r44(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, n_groups: int, tp: int
) -> None:
    """R44: with checksums on, MambaMixer2.get_kv_cache_spec (through the
    plugin's wrapper on vLLM 0.33.0, vLLM's own `get_state_splits` with the
    in-tree series) returns a spec carrying the calculator's splits for
    the checkpoint's group count: one group at TP > 1 means replicated B/C
    (the layer's own n_groups is already padded). With checksums off the
    spec is vLLM's, untouched. Bug caught: reading the padded n_groups (TP 2,
    one group would get R = 1 and fail every heterogeneous-TP load)."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import (
        make_vllm_config,
        register_plugin,
    )
    from tests.v1.kv_connector.unit.kv_checksum_pd import (
        CARRIER_CONNECTOR_NAME,
        register_carrier_connector,
    )
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    register_plugin()
    register_carrier_connector()
    for enabled in (True, False):
        config = make_vllm_config(
            model_dir,
            tp_size=tp,
            kv_connector=CARRIER_CONNECTOR_NAME,
            extra_config={"enable_kv_checksum": enabled},
        )
        config.cache_config.mamba_block_size = 16
        spec = MambaMixer2.get_kv_cache_spec(_mixer2(n_groups, tp, monkeypatch), config)
        assert isinstance(spec, MambaSpec)
        expected = mamba_splits.mamba2_state_splits(tp, 64, n_groups, 8, 4, False)
        assert mamba_splits.state_splits_of(spec) == (expected if enabled else None)
        assert not enabled or expected is not None


# --------------------------------------------------------------------------
# Operator fault injection into state blocks (R131)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bit_flip", "zero_block", "stale_block"])
@pytest.mark.parametrize("family_name", ["mamba1", "mamba2_g1", "gdn"])
def test_fault_injector_corrupts_state_blocks_r131(
    world: Any, family_name: str, kind: str
) -> None:
    """R131: the injector corrupts a loaded Mamba state block (a bit flip in
    the covered states on rank 0, the zeroed state, or another block's state:
    a stale read / another request's state) on a TP 2 consumer of a TP 1
    producer, and the load mismatches in exactly the injected group. Bug
    caught: Mamba groups left uncovered (the injector then skips them and a
    corrupted state would pass)."""
    from vllm.distributed.kv_transfer.kv_checksum.faults.injector import (
        KVFaultInjector,
    )

    family = FAMILIES[family_name]
    states = world(family)
    producer = make_ranks(family, 1, dim_first=False)
    consumer = make_ranks(family, 2, dim_first=True)
    fill(producer, family, states, P_BLOCKS, dim_first=False)
    fill(consumer, family, states, C_BLOCKS, dim_first=True)
    # Other blocks hold other requests' states (stale sources).
    others = {gid: b for gid, b in zip(GROUPS, (4, 7))}
    fill(consumer, family, world(family), others, dim_first=True)
    sent = reports(producer, P_BLOCKS, send=True)
    payload = build_producer_payload(sent, scheduled(P_BLOCKS), 1, 1, INFOS)
    assert not isinstance(payload, str)
    received = {}
    injected = set()
    for rank, r in enumerate(consumer):
        injector = KVFaultInjector(1.0, (kind,), seed=3, tp_rank=rank)
        r.worker.bind(KVChecksumScheduled(reqs_to_recv={"req": scheduled(C_BLOCKS)}))
        for injection in injector.corrupt_loads(r.worker, ["req"]):
            injected.add((injection.kind, injection.group_id))
        pending = r.worker.post_forward(["req"])
        assert pending is not None
        report = KVChecksumWorkerReport.from_record(pending.finalize(), "req")
        assert report is not None
        received[(0, rank)] = report
    assert len(injected) == 1
    applied, gid = injected.pop()
    assert applied == kind
    verdict = verify_load(payload, None, received, scheduled(C_BLOCKS), 2, 2, INFOS)
    assert verdict.status == KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {gid: [0]}
