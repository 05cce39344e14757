# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side KV checksums on CPU against the independent reference (R17-R55).

Every test draws one global truth KV ``uint8 [layers, tokens, global heads, C]``,
scatters it into the per-layer caches vLLM 0.33.0 allocates for each worker
(its TP heads, its PP layers, its block ids) and compares what the workers
report with `kv_checksum_reference`, which shares no code with the package.
"""

import hashlib
import pickle
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit import kv_checksum_reference as ref
from vllm.distributed.kv_transfer.kv_checksum.definition import kernels
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    pack_segments,
    segment_rows,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    KVChecksumWorker,
    WorkerTopology,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

CPU = torch.device("cpu")
U64 = np.uint64
NUM_BLOCKS = 8
REQ = "req-0"


# --------------------------------------------------------------------------
# Fixtures (cuda_stream_stubs comes from conftest.py, R55)
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Building workers from one global truth
# --------------------------------------------------------------------------


def name(i: int, prefix: str = "model.layers", suffix: str = "self_attn.attn"):
    return f"{prefix}.{i}.{suffix}"


def attn(heads: int, block_size: int = 16, cell: int = 16, **kw) -> FullAttentionSpec:
    """A float16 attention spec whose K+V cell is `cell` bytes (head_size = C/4)."""
    cls = kw.pop("cls", FullAttentionSpec)
    return cls(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=cell // 4,
        dtype=kw.pop("dtype", torch.float16),
        **kw,
    )


def mla(block_size: int = 16, cell: int = 16, **kw) -> MLAAttentionSpec:
    """A one-head float16 MLA spec whose latent cell is `cell` bytes."""
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=cell // 2,
        dtype=torch.float16,
        **kw,
    )


def spec_of(group: KVCacheGroupSpec, layer: str) -> KVCacheSpec:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer]
    return spec


def allocate(
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: int = NUM_BLOCKS,
    kernel_block_sizes: list[int] | None = None,
    aliases: Mapping[str, str] | None = None,
    skip: Sequence[str] = (),
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's allocation of every layer (layer-major pages), aliases added after.

    Layers in `skip` get no allocation (tests add hand-made caches for them).
    """
    aliases = dict(aliases or {})
    placed: list[tuple[str, int, int]] = []
    offset = 0
    for group in groups:
        for layer in group.layer_names:
            if layer in aliases or layer in skip:
                continue
            page = spec_of(group, layer).page_size_bytes
            placed.append((layer, page, offset))
            offset += page * num_blocks
    tensors = [
        KVCacheTensor(
            size=offset,
            layers=[layer],
            layer_stride=page * num_blocks,
            block_stride=page,
            offset=off,
        )
        for layer, page, off in placed
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=list(groups)
    )
    caches = allocate_kv_cache(config, CPU, KVCacheLayout.LBHNC, kernel_block_sizes)
    for alias, target in aliases.items():
        caches[alias] = caches[target]
    return config, caches


def tp_heads(num_heads: int, tp_rank: int, tp_size: int) -> list[int]:
    """The global KV heads vLLM gives a TP rank (replicated when TP > heads)."""
    if num_heads >= tp_size:
        local = num_heads // tp_size
        return list(range(tp_rank * local, (tp_rank + 1) * local))
    return [tp_rank // (tp_size // num_heads)]


def make_worker(
    config: KVCacheConfig,
    caches: Mapping[str, torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    model_heads: int | None = None,
    drafters: Sequence[str] = (),
) -> KVChecksumWorker:
    topology = WorkerTopology(
        tp_rank, tp_size, pp_rank, config.num_blocks, model_heads, CPU
    )
    worker = KVChecksumWorker(config, caches, topology, drafter_layer_names=drafters)
    worker.warm_up()
    return worker


def truth_worker(
    kv: np.ndarray,
    block_ids: Sequence[int],
    block_size: int = 16,
    layers: Sequence[int] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    kernel_block: int | None = None,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 0,
    **spec_kw,
) -> KVChecksumWorker:
    """One worker of an attention model whose global KV is `kv`.

    Layer i of `kv` is "model.layers.i"; the worker holds `layers` (its PP
    stage) and the heads of its TP rank; the request's position b lives in
    block `block_ids[b]`; every other slot holds random garbage.
    """
    num_layers, _, num_heads, cell = kv.shape
    layers = range(num_layers) if layers is None else layers
    heads = tp_heads(num_heads, tp_rank, tp_size)
    spec = attn(len(heads), block_size, cell, **spec_kw)
    names = [name(i) for i in layers]
    config, caches = allocate(
        [KVCacheGroupSpec(names, spec)],
        num_blocks,
        [kernel_block] if kernel_block else None,
    )
    ref.fill_caches(caches, seed)
    ref.scatter_kv(
        kv,
        caches,
        {name(i): i for i in layers},
        heads,
        block_ids,
        block_size,
        num_blocks,
    )
    return make_worker(config, caches, tp_rank, tp_size, pp_rank, num_heads)


def blocks(num_tokens: int, *groups: tuple[int, int, Sequence[int]]):
    """KVChecksumBlocks from (group id, start position, block ids) entries."""
    return KVChecksumBlocks(
        num_tokens,
        {gid: (start, np.asarray(ids, dtype=np.int64)) for gid, start, ids in groups},
    )


def send(worker: KVChecksumWorker, reqs: Mapping[str, KVChecksumBlocks]):
    """One step sending `reqs`; the host record."""
    worker.bind(KVChecksumScheduled(reqs_to_send=dict(reqs)))
    pending = worker.post_forward(
        finished_recving=set(), failed_recving=set(), received={}, finished_req_ids=()
    )
    assert pending is not None
    return pending.finalize()


def recv(worker: KVChecksumWorker, reqs: Mapping[str, KVChecksumBlocks]):
    """One step binding receives `reqs` whose loads finish in that step."""
    worker.bind(KVChecksumScheduled(reqs_to_recv=dict(reqs)))
    pending = worker.post_forward(
        finished_recving=set(reqs), failed_recving=set(), received={}
    )
    assert pending is not None
    return pending.finalize()


def u64_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    with np.errstate(over="ignore"):
        total = np.zeros_like(np.asarray(arrays[0], dtype=U64))
        for a in arrays:
            total = total + np.asarray(a, dtype=U64)
    return total


def replica0_sum(groups: Sequence[KVChecksumGroup]) -> np.ndarray:
    """What a producer sends (R80): all columns of all workers; replica 0 only."""
    parts = []
    for g in groups:
        assert all(r == 0 for _, r in g.replica_keys), g.replica_keys
        with np.errstate(over="ignore"):
            parts.append(g.values.sum(axis=1, dtype=U64))
    return u64_sum(parts)


def replica_checks(groups: Sequence[KVChecksumGroup]) -> list[np.ndarray]:
    """R91: check_k = sum over replica counts R of T[(R, k mod R)]."""
    totals: dict[tuple[int, int], list[np.ndarray]] = {}
    for g in groups:
        for k, key in enumerate(g.replica_keys):
            totals.setdefault(key, []).append(g.values[:, k])
    t = {key: u64_sum(parts) for key, parts in totals.items()}
    counts = sorted({r for r, _ in t})
    return [u64_sum([t[(r, k % r)] for r in counts]) for k in range(max(counts))]


def hexes(values) -> list[str]:
    return [hex(int(v)) for v in values]


# --------------------------------------------------------------------------
# Definition vectors (R24, R26)
# --------------------------------------------------------------------------

TV4_4 = [0xD94843158FE0FF93, 0x978412190698D0FE, 0xABF2AD2F1BE94A85]
TV4_8 = [0x70CC552E9679D091, 0xABF2AD2F1BE94A85]
TV4_TP2 = [
    [0x527CAC8539AAEC52, 0x2E8FFE2256C827E7, 0x93835FBD798CD8F4],
    [0x86CB969056361341, 0x68F413F6AFD0A917, 0x186F4D71A25C7191],
]
# Definition v2 (R137): pieces mixed by SplitMix64's finalizer.
MIX_1, MIX_2, MIX_MAX = 0x5692161D100B05E5, 0xDBD238973A2B148A, 0xB4D055FCF2CBBD7B
TV1, TV2, TV3 = 0xEA08BFE2BE8C4383, 0xE602BC4BBCDBD895, 0x1E7101F6D8633871
# TV5 recomputed under v2 by this reference (recorded in the guide).
TV5_S, TV5_C = 0xBAE0D519661BEE86, 0x5C0EC0871D4B3FC2
FP_LAYER0 = 0xD8FE581622DF5382
FP_GROUP01 = 0xB85A9AFD67B6FCBD


def test_reference_vectors():
    """R24/R26/R137: the NumPy reference and the exact-int one give the v2
    vectors f(1), f(2), f(2^64 - 1) and TV1-TV5.

    Catches a reference that promotes to float or signed ints, shifts
    arithmetically, forgets the mix, or numbers pieces from the block instead
    of the request start."""
    pieces = np.array([1, 2, (1 << 64) - 1], dtype=U64)
    assert [int(v) for v in ref.mix64(pieces)] == [MIX_1, MIX_2, MIX_MAX]
    assert [ref.exact_mix64(int(v)) for v in pieces] == [MIX_1, MIX_2, MIX_MAX]
    assert ref.exact_mix64(0) == 0
    tv1 = ref.pieces_kv([[[1]], [[2]]])
    for fn in (ref.reference_block_checksums, ref.exact_block_checksums):
        assert list(fn(tv1, 16)) == [TV1]
        assert list(fn(tv1, 16, layer_numbers=[1], head_numbers=[3])) == [TV2]
        tv3 = ref.pieces_kv([[[(1 << 64) - 1]]])
        assert list(fn(tv3, 16, head_numbers=[1])) == [TV3]
        kv = ref.tv4_kv()
        assert [int(v) for v in fn(kv, 4)] == TV4_4
        assert [int(v) for v in fn(kv, 8)] == TV4_8
        for h in range(2):
            got = fn(kv[:, :, h : h + 1], 4, head_numbers=[h])
            assert [int(v) for v in got] == TV4_TP2[h]
    assert int(u64_sum([np.array(v, dtype=U64) for v in TV4_TP2])[0]) == TV4_4[0]
    # TV5 (R21, R25): unsigned 16-bit elements, layer 2, row 5.
    s, c = ref.split_row_checksum([0xFFFF, 0x0001, 0x8000], 2, 2 * ref.H + 5)
    assert (s, c) == (TV5_S, TV5_C)
    assert ref.reference_fingerprint(
        [("model.layers.0.self_attn.attn", "FullAttentionSpec", "torch.bfloat16")]
    ) == (FP_LAYER0)


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_exact_ints(seed):
    """R24: the uint64 NumPy reference equals exact Python ints mod 2^64.

    Catches overflow handled by float or signed promotion in the reference."""
    rng = np.random.default_rng(seed)
    kv = ref.random_kv(rng, 2, 11, 3, 16)
    # Pieces near 2^64 make every product wrap.
    kv[:, ::2] = 0xFF
    layers, heads = [7, 65535], [0, 40000, 65535]
    for bs in (1, 4, 16):
        for n in (0, 5, 11):
            got = ref.reference_block_checksums(kv, bs, n, layers, heads)
            want = ref.exact_block_checksums(kv, bs, n, layers, heads)
            assert [int(v) for v in got] == want


def _tiny_worker(pieces_by_token, layer, heads_total, tp_rank, tp_size):
    """A worker whose one head of layer `layer` holds P = 1 pieces per token."""
    kv = ref.pieces_kv(pieces_by_token)  # [1, T, 1, 8]
    spec = attn(1, block_size=16, cell=8)
    config, caches = allocate([KVCacheGroupSpec([name(layer)], spec)])
    ref.fill_caches(caches, 1)
    ref.scatter_kv(kv, caches, {name(layer): 0}, [0], [3], 16, NUM_BLOCKS)
    return make_worker(config, caches, tp_rank, tp_size, 0, heads_total)


@pytest.mark.parametrize(
    "pieces, layer, heads_total, tp_rank, tp_size, expected",
    [
        ([[[1]], [[2]]], 0, 1, 0, 1, TV1),
        ([[[1]], [[2]]], 1, 4, 3, 4, TV2),  # global head 3 on rank 3
        ([[[(1 << 64) - 1]]], 0, 2, 1, 2, TV3),  # head 1
    ],
    ids=["TV1", "TV2", "TV3"],
)
def test_worker_vectors_tv1_to_tv3(
    pieces, layer, heads_total, tp_rank, tp_size, expected
):
    """R26 TV1-TV3 through a real worker (global heads on TP ranks > 0).

    Catches heads numbered per rank (first slice without shard * heads, R33),
    a wrong layer factor, or signed arithmetic."""
    worker = _tiny_worker(pieces, layer, heads_total, tp_rank, tp_size)
    record = send(worker, {REQ: blocks(len(pieces), (0, 0, [3]))})
    group = record.checksums[REQ][0]
    assert group.start == 0
    assert group.replica_keys == ((1, 0),)
    assert [int(v) for v in group.values[:, 0]] == [expected]


@pytest.mark.parametrize("block_size, expected", [(4, TV4_4), (8, TV4_8)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_worker_vector_tv4(block_size, expected, tp_size):
    """R26 TV4 through real worker views: layers 0-1, 2 heads, C = 16, 10 tokens.

    At TP2 each rank gives its listed shard values and they sum to TP1. Catches
    a dropped block-start term (R63), heads numbered per rank (R33) and slots
    past num_tokens counted (R20)."""
    kv = ref.tv4_kv()
    num_pos = len(expected)
    block_ids = [5, 2, 7][:num_pos]
    parts = []
    for rank in range(tp_size):
        worker = truth_worker(kv, block_ids, block_size, tp_rank=rank, tp_size=tp_size)
        group = send(worker, {REQ: blocks(10, (0, 0, block_ids))}).checksums[REQ][0]
        if tp_size == 2 and block_size == 4:
            assert [int(v) for v in group.values[:, 0]] == TV4_TP2[rank]
        parts.append(group)
    assert [int(v) for v in replica0_sum(parts)] == expected


def test_fingerprint_vectors():
    """R26/R42: the listed fingerprint of one layer and of a two-layer group.

    Catches a fingerprint over another identity text or byte order."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=4, dtype=torch.bfloat16
    )
    for names, want in (([name(0)], FP_LAYER0), ([name(0), name(1)], FP_GROUP01)):
        config, caches = allocate([KVCacheGroupSpec(names, spec)])
        assert make_worker(config, caches).fingerprints == {0: want}
        identities = [(n, "FullAttentionSpec", "torch.bfloat16") for n in names]
        assert ref.reference_fingerprint(identities) == want


# --------------------------------------------------------------------------
# Layouts, TP and PP (R22, R27, R31-R33)
# --------------------------------------------------------------------------


def _layout_caches(layout: KVCacheLayout, kernel_block: int | None, names, spec):
    """One backing tensor for all layers, placed as `layout` needs."""
    p, b, h, n_layers = spec.page_size_bytes, NUM_BLOCKS, spec.num_kv_heads, len(names)
    placement = {
        KVCacheLayout.LBHNC: (p * b, p),
        KVCacheLayout.LBNHC: (p * b, p),
        KVCacheLayout.LHBNC: (p * b, p // h),
        KVCacheLayout.BLHNC: (p, p * n_layers),
        KVCacheLayout.BLNHC: (p, p * n_layers),
        KVCacheLayout.BHLNC: (p // h, p * n_layers),
    }
    layer_stride, block_stride = placement[layout]
    tensor = KVCacheTensor(
        size=p * b * n_layers,
        layers=list(names),
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=b,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec)],
    )
    kernel_sizes = [kernel_block] if kernel_block else None
    return config, allocate_kv_cache(config, CPU, layout, kernel_sizes)


LAYOUT_CASES = [(layout, None) for layout in KVCacheLayout] + [
    (KVCacheLayout.LBHNC, 8),
    (KVCacheLayout.LBNHC, 8),
    (KVCacheLayout.LBNHC, 4),
]


@pytest.mark.parametrize(
    "layout, kernel_block",
    LAYOUT_CASES,
    ids=[f"{lay.name}-kb{kb}" for lay, kb in LAYOUT_CASES],
)
def test_layouts_and_kernel_blocks(layout, kernel_block):
    """R22/R27/R31: every KVCacheLayout and kernel-block split equals the reference.

    Uses vLLM's allocate_kv_cache with the placement each layout needs. Catches
    a view that assumes head-major or contiguous blocks, or kernel blocks
    numbered as heads instead of consecutive token slots."""
    rng = np.random.default_rng(3)
    kv = ref.random_kv(rng, 3, 45, 2, 32)
    names = [name(i) for i in range(3)]
    spec = attn(2, 16, 32, dtype=torch.bfloat16)
    config, caches = _layout_caches(layout, kernel_block, names, spec)
    ref.fill_caches(caches, 7)
    block_ids = [6, 0, 3]
    ref.scatter_kv(
        kv,
        caches,
        {n: i for i, n in enumerate(names)},
        [0, 1],
        block_ids,
        16,
        NUM_BLOCKS,
    )
    worker = make_worker(config, caches)
    group = send(worker, {REQ: blocks(45, (0, 0, block_ids))}).checksums[REQ][0]
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(group.values[:, 0]) == hexes(want)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
def test_padded_pages(layout):
    """R31: padded attention pages (page_size_padded) are read through strides.

    Catches views assuming dense pages (reading padding as the next block)."""
    rng = np.random.default_rng(4)
    kv = ref.random_kv(rng, 2, 40, 2, 16)
    names = [name(0), name(1)]
    dense = attn(2).page_size_bytes
    spec = attn(2, page_size_padded=dense + 64)
    config, caches = _layout_caches(layout, None, names, spec)
    assert caches[names[0]].stride(0) != dense // 2  # float16 elements
    ref.fill_caches(caches, 8)
    ref.scatter_kv(
        kv, caches, {names[0]: 0, names[1]: 1}, [0, 1], [7, 3, 4], 16, NUM_BLOCKS
    )
    worker = make_worker(config, caches)
    group = send(worker, {REQ: blocks(40, (0, 0, [7, 3, 4]))}).checksums[REQ][0]
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(group.values[:, 0]) == hexes(want)


@pytest.mark.parametrize("tp_size, pp_size", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_tp_pp_parts_sum_to_whole(tp_size, pp_size):
    """R3/R22/R33: TP shards and PP stages sum to the TP1 value, each part exact.

    Every worker's value equals the reference over its own heads and layers,
    and the replica-0 sum over all workers equals the whole model. Catches
    heads numbered per rank (first slice without shard * heads), layers
    numbered per stage, and parts that do not add up."""
    rng = np.random.default_rng(tp_size * 10 + pp_size)
    kv = ref.random_kv(rng, 4, 37, 4, 16)
    block_ids = [1, 4, 6]
    whole = ref.reference_block_checksums(kv, 16)
    per_stage = 4 // pp_size
    parts = []
    for pp_rank in range(pp_size):
        layers = list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
        for tp_rank in range(tp_size):
            worker = truth_worker(
                kv,
                block_ids,
                layers=layers,
                tp_rank=tp_rank,
                tp_size=tp_size,
                pp_rank=pp_rank,
            )
            record = send(worker, {REQ: blocks(37, (0, 0, block_ids))})
            assert (record.pp_rank, record.tp_rank) == (pp_rank, tp_rank)
            group = record.checksums[REQ][0]
            heads = tp_heads(4, tp_rank, tp_size)
            own = ref.reference_block_checksums(
                kv[layers][:, :, heads], 16, layer_numbers=layers, head_numbers=heads
            )
            assert hexes(group.values[:, 0]) == hexes(own)
            parts.append(group)
    assert hexes(replica0_sum(parts)) == hexes(whole)


def test_replicated_heads_tp4_two_heads():
    """R32/R33/R46/R91: TP4 with 2 KV heads: keys (2,0)/(2,1), replica 0 sends.

    The send pass covers only replica-0 views and sums to the truth; the receive
    pass has every replica column and each replica's check equals the truth.
    Catches replicas counted twice in the payload or replica copies never
    checked."""
    rng = np.random.default_rng(5)
    kv = ref.random_kv(rng, 2, 30, 2, 16)
    block_ids = [2, 3]
    want = ref.reference_block_checksums(kv, 16)
    sends, recvs = [], []
    for rank in range(4):
        worker = truth_worker(kv, block_ids, tp_rank=rank, tp_size=4)
        sent = send(worker, {REQ: blocks(30, (0, 0, block_ids))}).checksums[REQ][0]
        got = recv(worker, {REQ: blocks(30, (0, 0, block_ids))}).checksums[REQ][0]
        replica = rank % 2
        assert got.replica_keys == ((2, replica),)
        # R135: a producer record folds its replica-0 views into one column;
        # a replica-1 rank holds none and reports zeros.
        assert sent.replica_keys == ((1, 0),)
        if replica:
            assert not sent.values.any()
        sends.append(sent)
        recvs.append(got)
    assert hexes(replica0_sum(sends)) == hexes(want)
    checks = replica_checks(recvs)
    assert len(checks) == 2
    for check in checks:
        assert hexes(check) == hexes(want)


@pytest.mark.parametrize("max_tp_shards", [1, None])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_mla_one_head_replicated(max_tp_shards, tp_size):
    """R32: a one-head MLA cache is held whole by every rank (replicas = TP).

    With max_tp_shards = 1 or unset and model KV heads 8 (which would give the
    non-MLA rule TP // 8 = 0). Catches MLA numbered as sharded heads or
    skipped as unknown replication."""
    rng = np.random.default_rng(tp_size)
    kv = ref.random_kv(rng, 2, 20, 1, 16)
    names = [name(0), name(1)]
    spec = mla(16, 16, max_tp_shards=max_tp_shards)
    want = ref.reference_block_checksums(kv, 16)
    sends, recvs = [], []
    for rank in range(tp_size):
        config, caches = allocate([KVCacheGroupSpec(names, spec)])
        ref.fill_caches(caches, rank)
        ref.scatter_kv(
            kv, caches, {names[0]: 0, names[1]: 1}, [0], [4, 1], 16, NUM_BLOCKS
        )
        worker = make_worker(config, caches, rank, tp_size, 0, model_heads=8)
        assert worker.skipped_groups == ()
        sends.append(send(worker, {REQ: blocks(20, (0, 0, [4, 1]))}).checksums[REQ][0])
        got = recv(worker, {REQ: blocks(20, (0, 0, [4, 1]))}).checksums[REQ][0]
        assert got.replica_keys == ((tp_size, rank),)
        recvs.append(got)
    assert hexes(replica0_sum(sends)) == hexes(want)
    for check in replica_checks(recvs):
        assert hexes(check) == hexes(want)


def _module_group(attn_spec, index_spec, layers):
    """A mixed-spec group of attention + indexer caches per layer module."""
    specs: dict[str, KVCacheSpec] = {}
    for i in layers:
        specs[name(i, suffix="self_attn.attn")] = attn_spec
        specs[name(i, suffix="self_attn.indexer")] = index_spec
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
    return KVCacheGroupSpec(list(specs), uniform)


def _module_worker(
    kv_attn,
    kv_index,
    tp_rank,
    tp_size,
    attn_spec,
    index_spec,
    block_ids,
    index_heads=(0,),
):
    """A worker of the two-caches-per-module model (global attention heads of
    `kv_attn`, indexer heads `index_heads` of `kv_index`)."""
    layers = range(kv_attn.shape[0])
    group = _module_group(attn_spec, index_spec, layers)
    config, caches = allocate([group])
    ref.fill_caches(caches, tp_rank + 11)
    heads = tp_heads(kv_attn.shape[2], tp_rank, tp_size)
    ref.scatter_kv(
        kv_attn, caches, {name(i): i for i in layers}, heads, block_ids, 16, NUM_BLOCKS
    )
    index_names = {name(i, suffix="self_attn.indexer"): i for i in layers}
    ref.scatter_kv(
        kv_index, caches, index_names, index_heads, block_ids, 16, NUM_BLOCKS
    )
    return make_worker(config, caches, tp_rank, tp_size, 0, kv_attn.shape[2])


def test_module_caches_numbered_consecutively():
    """R35: two caches of one module number heads consecutively in name order.

    "...self_attn.attn" (2 heads) takes global heads 0-1 and "...indexer" (1
    head, its own cell size) head 2 of the same layer. Catches every cache of a
    module numbered from head 0 (swapped or equal caches would cancel out)."""
    rng = np.random.default_rng(9)
    kv_attn = ref.random_kv(rng, 2, 21, 2, 16)
    kv_index = ref.random_kv(rng, 2, 21, 1, 32)
    worker = _module_worker(kv_attn, kv_index, 0, 1, attn(2), mla(cell=32), [0, 7])
    group = send(worker, {REQ: blocks(21, (0, 0, [0, 7]))}).checksums[REQ][0]
    want = u64_sum(
        [
            ref.reference_block_checksums(kv_attn, 16),
            ref.reference_block_checksums(kv_index, 16, head_numbers=[2]),
        ]
    )
    assert hexes(group.values[:, 0]) == hexes(want)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_mixed_spec_group_replica_checks(tp_size):
    """R32/R35/R91: attention sharded at TP2 / replicated at TP4 plus a one-head
    indexer on every rank (max_tp_shards = 1) equals the definition.

    The send sum and every replica check equal the global definition. Catches
    replica keys mixed up between the caches of a module, or the indexer's
    heads numbered per rank."""
    rng = np.random.default_rng(tp_size + 20)
    kv_attn = ref.random_kv(rng, 2, 40, 2, 16)
    kv_index = ref.random_kv(rng, 2, 40, 1, 16)
    want = ref.reference_block_checksums(np.concatenate([kv_attn, kv_index], 2), 16)
    index_spec = attn(1, max_tp_shards=1)
    sends, recvs = [], []
    for rank in range(tp_size):
        worker = _module_worker(
            kv_attn, kv_index, rank, tp_size, attn(1), index_spec, [3, 5, 6]
        )
        reqs = {REQ: blocks(40, (0, 0, [3, 5, 6]))}
        sends.append(send(worker, reqs).checksums[REQ][0])
        got = recv(worker, reqs).checksums[REQ][0]
        attn_key = (1, 0) if tp_size == 2 else (2, rank % 2)
        assert set(got.replica_keys) == {attn_key, (tp_size, rank)}
        recvs.append(got)
    assert hexes(replica0_sum(sends)) == hexes(want)
    checks = replica_checks(recvs)
    assert len(checks) == tp_size
    for check in checks:
        assert hexes(check) == hexes(want)


# --------------------------------------------------------------------------
# Properties: swaps, partial blocks, block sizes, KV sharing (R20, R22, R27, R29)
# --------------------------------------------------------------------------


def _values(kv, block_ids, num_tokens, **kw) -> np.ndarray:
    """Block checksums of one worker: its receive pass's 16-token chunk values
    (R135) summed per block."""
    worker = truth_worker(kv, block_ids, **kw)
    group = recv(worker, {REQ: blocks(num_tokens, (0, 0, block_ids))}).checksums[REQ]
    chunks = group[0].values[:, 0].reshape(len(block_ids), -1)
    with np.errstate(over="ignore"):
        return chunks.sum(axis=1, dtype=U64)


@pytest.mark.parametrize("num_tokens", [64, 50, 33, 7])
@pytest.mark.parametrize("block_size", [32, 64])
def test_send_pass_reports_16_token_chunks(num_tokens, block_size):
    """R135: a producer worker with blocks larger than 16 tokens reports one
    value per 16-token chunk, from chunk start * block_size / 16 on, equal to
    the definition's 16-token block checksums; chunks past the last token are
    zero. Catches chunk views without their token offset (weights counted
    from the block start) or chunks reported per block."""
    rng = np.random.default_rng(num_tokens + block_size)
    kv = ref.random_kv(rng, 2, num_tokens, 2, 16)
    count = -(-num_tokens // block_size)
    ids = [5, 6, 1][:count]
    worker = truth_worker(kv, ids, block_size=block_size)
    sent = send(worker, {REQ: blocks(num_tokens, (0, 0, ids))}).checksums[REQ][0]
    per_block = block_size // 16
    assert sent.start == 0 and sent.values.shape == (count * per_block, 1)
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(sent.values[: len(want), 0]) == hexes(want)
    assert not sent.values[len(want) :].any()


def test_swaps_change_value():
    """R22/R27: swapping tokens, blocks, heads or layers changes the checksum.

    Catches weights independent of token position (tokens, blocks), slice
    factors independent of head or layer, and per-block instead of per-request
    token numbering (two swapped blocks keep their sum)."""
    rng = np.random.default_rng(11)
    kv = ref.random_kv(rng, 2, 32, 2, 16)
    ids = [2, 6]
    base = _values(kv, ids, 32)
    assert hexes(base) == hexes(ref.reference_block_checksums(kv, 16))

    tokens = kv.copy()
    tokens[:, [3, 4]] = tokens[:, [4, 3]]
    got = _values(tokens, ids, 32)
    assert got[0] != base[0] and got[1] == base[1]

    # The blocks of positions 0 and 1 read each other's block.
    worker = truth_worker(kv, ids)
    record = send(worker, {REQ: blocks(32, (0, 0, ids[::-1]))})
    swapped_blocks = record.checksums[REQ][0].values[:, 0]
    assert swapped_blocks[0] != base[0] and swapped_blocks[1] != base[1]
    with np.errstate(over="ignore"):
        assert swapped_blocks.sum(dtype=U64) != base.sum(dtype=U64)

    heads = kv[:, :, ::-1].copy()
    assert np.all(_values(heads, ids, 32) != base)
    layers = kv[::-1].copy()
    assert np.all(_values(layers, ids, 32) != base)


def test_module_cache_swap_changes_value():
    """R35: swapping data between a layer's two caches changes c.

    Catches both caches of a module numbered from the same first head."""
    rng = np.random.default_rng(12)
    a = ref.random_kv(rng, 1, 16, 1, 16)
    b = ref.random_kv(rng, 1, 16, 1, 16)
    spec = attn(1, max_tp_shards=1)
    values = []
    for kv_attn, kv_index in ((a, b), (b, a)):
        worker = _module_worker(kv_attn, kv_index, 0, 1, spec, spec, [1])
        record = send(worker, {REQ: blocks(16, (0, 0, [1]))})
        values.append(int(record.checksums[REQ][0].values[0, 0]))
    assert values[0] != values[1]


def test_slots_past_num_tokens_ignored():
    """R20: slots at or past num_tokens (future decode/draft tokens) are excluded.

    Garbage after token 21 and a different garbage seed give the same values,
    which equal the reference over 21 tokens. Catches unmasked last blocks."""
    rng = np.random.default_rng(13)
    kv = ref.random_kv(rng, 2, 21, 2, 16)
    first = _values(kv, [3, 0], 21, seed=1)
    second = _values(kv, [3, 0], 21, seed=2)
    assert hexes(first) == hexes(second)
    assert hexes(first) == hexes(ref.reference_block_checksums(kv, 16))
    # The same truth written further (tokens 21..31 set) but only 21 counted.
    longer = np.concatenate([kv, ref.random_kv(rng, 2, 11, 2, 16)], axis=1)
    assert hexes(_values(longer, [3, 0], 21)) == hexes(first)
    # An empty last block (all slots past num_tokens) is zero.
    worker = truth_worker(kv, [3, 0, 5])
    record = send(worker, {REQ: blocks(21, (0, 0, [3, 0, 5]))})
    assert int(record.checksums[REQ][0].values[2, 0]) == 0


@pytest.mark.parametrize("num_tokens", [64, 50, 33])
def test_small_blocks_add_up_to_large(num_tokens):
    """R22/R27: two 16-token blocks add up to the 32-token block, also partial.

    Catches token weights numbered from the block instead of the request."""
    rng = np.random.default_rng(num_tokens)
    kv = ref.random_kv(rng, 2, num_tokens, 2, 16)
    small = _values(kv, [0, 1, 2, 3][: -(-num_tokens // 16)], num_tokens)
    large = _values(kv, [5, 6][: -(-num_tokens // 32)], num_tokens, block_size=32)
    padded = np.zeros(2 * len(large), dtype=U64)
    padded[: len(small)] = small
    with np.errstate(over="ignore"):
        pairs = padded[0::2] + padded[1::2]
    assert hexes(pairs) == hexes(large)
    assert hexes(large) == hexes(ref.reference_block_checksums(kv, 32))


@pytest.mark.parametrize("alias_first", [False, True])
def test_kv_sharing_counted_once(alias_first):
    """R29/R42: two layer names mapped to one tensor count once, under the lowest
    (layer number, name); the fingerprint includes the alias.

    alias_first=False: layer 2 shares layer 0's cache (counted as layer 0).
    alias_first=True: layer 0 is the name of layer 1's cache (counted as layer
    0). Catches aliases counted twice or under the wrong layer."""
    rng = np.random.default_rng(14)
    kv = ref.random_kv(rng, 2, 24, 2, 16)
    spec = attn(2)
    names = [name(0), name(1), name(2)]
    if alias_first:
        aliases, layer_index = {name(0): name(2)}, {name(1): 1, name(2): 0}
        numbers = [0, 1]  # layer 2's cache counts under layer 0
    else:
        aliases, layer_index = {name(2): name(0)}, {name(0): 0, name(1): 1}
        numbers = [0, 1]
    config, caches = allocate([KVCacheGroupSpec(names, spec)], aliases=aliases)
    assert caches[name(0)].data_ptr() == caches[name(2)].data_ptr()
    ref.fill_caches(caches, 3)
    ref.scatter_kv(kv, caches, layer_index, [0, 1], [1, 2], 16, NUM_BLOCKS)
    worker = make_worker(config, caches)
    group = send(worker, {REQ: blocks(24, (0, 0, [1, 2]))}).checksums[REQ][0]
    want = ref.reference_block_checksums(kv, 16, layer_numbers=numbers)
    assert hexes(group.values[:, 0]) == hexes(want)
    identities = [(n, "FullAttentionSpec", "torch.float16") for n in names]
    assert worker.fingerprints == {0: ref.reference_fingerprint(identities)}


def test_drafter_layers_removed():
    """R28: drafter layers are left out of values and fingerprints; a group of
    drafter layers only is neither checksummed nor skipped.

    Catches drafter KV (which only decides accepted drafts) in the checksum."""
    rng = np.random.default_rng(15)
    kv = ref.random_kv(rng, 2, 16, 2, 16)
    spec = attn(2)
    drafter = "drafter.layers.5.self_attn.attn"
    g0 = KVCacheGroupSpec([name(0), name(1), drafter], spec)
    g1 = KVCacheGroupSpec(["drafter.layers.6.self_attn.attn"], attn(2, 32))
    config, caches = allocate([g0, g1])
    ref.fill_caches(caches, 4)
    ref.scatter_kv(kv, caches, {name(0): 0, name(1): 1}, [0, 1], [2], 16, NUM_BLOCKS)
    drafters = [drafter, "drafter.layers.6.self_attn.attn"]
    worker = make_worker(config, caches, drafters=drafters)
    assert worker.skipped_groups == ()
    identities = [(n, "FullAttentionSpec", "torch.float16") for n in g0.layer_names]
    assert worker.fingerprints == {0: ref.reference_fingerprint(identities[:2])}
    record = send(worker, {REQ: blocks(16, (0, 0, [2]), (1, 0, [3]))})
    assert set(record.checksums[REQ]) == {0}
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)


# --------------------------------------------------------------------------
# Groups the worker cannot checksum (R34)
# --------------------------------------------------------------------------


def _bad_group(kind: str):
    """(group spec, hand-made caches or None to allocate, topology kwargs, reason)."""
    bad = name(1)
    cache16 = torch.zeros(NUM_BLOCKS, 2, 16, 8, dtype=torch.float16)
    if kind == "a_host_resident":
        group = KVCacheGroupSpec([bad], attn(2), host_resident=True)
        return group, {bad: cache16}, {}, "its KV is host-resident"
    if kind == "b_missing_cache":
        return KVCacheGroupSpec([bad], attn(2)), {}, {}, "has no KV cache"
    if kind == "c_mamba_in_mixed_group":
        mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
        uniform = UniformTypeKVCacheSpecs(
            block_size=16, kv_cache_specs={bad: attn(2), name(2): mamba}
        )
        caches = {bad: cache16, name(2): torch.zeros(NUM_BLOCKS, 1, 1, 128)}
        return KVCacheGroupSpec([bad, name(2)], uniform), caches, {}, "Mamba"
    if kind == "d_no_single_layer_number":
        layer = "model.layers.1.experts.2.attn"
        group = KVCacheGroupSpec([layer], attn(2))
        return group, {layer: cache16}, {}, "no single layer number"
    if kind == "d_no_layer_number":
        group = KVCacheGroupSpec(["model.attn"], attn(2))
        return group, {"model.attn": cache16}, {}, "no single layer number"
    if kind == "e_two_modules":
        other = "mtp.layers.1.self_attn.attn"
        group = KVCacheGroupSpec([bad, other], attn(2))
        caches = {bad: cache16, other: cache16.clone()}
        return group, caches, {}, "used by two modules"
    if kind == "f_too_many_heads":
        # 2 heads on each of 32769 ranks: 65538 global heads > H.
        group = KVCacheGroupSpec([bad], attn(2))
        topo = {"tp_size": 32769, "model_heads": 65538}
        return group, {bad: cache16}, topo, "more than 65536 KV heads"
    if kind == "g_hisparse_spec":
        spec = HiSparseHotSpec(block_size=16, page_size=512, blocks_per_request=4)
        group = KVCacheGroupSpec([bad], spec)
        return group, {bad: torch.zeros(4096, dtype=torch.int8)}, {}, "per-token"
    if kind == "h_tokens_per_state":
        spec = attn(2, tokens_per_state=2)
        cache = torch.zeros(NUM_BLOCKS, 2, 8, 8, dtype=torch.float16)
        return KVCacheGroupSpec([bad], spec), {bad: cache}, {}, "compressed"
    if kind == "i_num_head_slots":
        spec = attn(2, num_head_slots=1)
        cache = torch.zeros(NUM_BLOCKS, 1, 16, 8, dtype=torch.float16)
        return KVCacheGroupSpec([bad], spec), {bad: cache}, {}, "head slots"
    if kind == "j_not_4d":
        cache = torch.zeros(NUM_BLOCKS, 2, 128, dtype=torch.float16)
        return KVCacheGroupSpec([bad], attn(2)), {bad: cache}, {}, "not 4-D"
    if kind == "j_blocks_not_multiple":
        cache = torch.zeros(NUM_BLOCKS + 1, 2, 16, 8, dtype=torch.float16)
        return KVCacheGroupSpec([bad], attn(2)), {bad: cache}, {}, "not 4-D"
    if kind == "k_cell_not_8_bytes":
        spec = attn(2, cell=4)  # head_size 1: K + V = 4 bytes
        cache = torch.zeros(NUM_BLOCKS, 2, 16, 2, dtype=torch.float16)
        return KVCacheGroupSpec([bad], spec), {bad: cache}, {}, "8-byte pieces"
    if kind == "k_stride_not_8_bytes":
        raw = torch.zeros(NUM_BLOCKS * 2 * 16 * 20, dtype=torch.int8)
        cache = raw.as_strided((NUM_BLOCKS, 2, 16, 16), (640, 320, 20, 1))
        return KVCacheGroupSpec([bad], attn(2)), {bad: cache}, {}, "8-byte pieces"
    if kind == "k_offset_not_8_bytes":
        raw = torch.zeros(NUM_BLOCKS * 2 * 16 * 16 + 4, dtype=torch.int8)
        cache = raw[4:].view(NUM_BLOCKS, 2, 16, 16)
        return KVCacheGroupSpec([bad], attn(2)), {bad: cache}, {}, "8-byte pieces"
    if kind == "l_kernel_blocks_not_tiling":
        cache = torch.zeros(NUM_BLOCKS * 2, 2, 4, 8, dtype=torch.float16)
        return KVCacheGroupSpec([bad], attn(2)), {bad: cache}, {}, "do not tile"
    if kind == "m_unknown_replication":
        cache = torch.zeros(NUM_BLOCKS, 1, 16, 8, dtype=torch.float16)
        topo = {"tp_size": 4, "model_heads": None}
        group = KVCacheGroupSpec([bad], attn(1))
        return group, {bad: cache}, topo, "replication of its KV heads is unknown"
    raise AssertionError(kind)


SKIP_KINDS = [
    "a_host_resident",
    "b_missing_cache",
    "c_mamba_in_mixed_group",
    "d_no_single_layer_number",
    "d_no_layer_number",
    "e_two_modules",
    "f_too_many_heads",
    "g_hisparse_spec",
    "h_tokens_per_state",
    "i_num_head_slots",
    "j_not_4d",
    "j_blocks_not_multiple",
    "k_cell_not_8_bytes",
    "k_stride_not_8_bytes",
    "k_offset_not_8_bytes",
    "l_kernel_blocks_not_tiling",
    "m_unknown_replication",
]


@pytest.mark.parametrize("kind", SKIP_KINDS)
def test_skipped_group_next_to_checksummed(kind, vllm_caplog):
    """R34: a group the worker cannot checksum is skipped with a logged reason,
    listed in every record, and the group beside it is still checksummed.

    The checksummed group is replicated (max_tp_shards = 1), so it is valid at
    every TP size used here. Catches a bad group aborting the worker, silently
    checksummed wrong, or not reported (the scheduler would count it missing)."""
    group, bad_caches, topo, reason = _bad_group(kind)
    good = KVCacheGroupSpec([name(0)], attn(2, max_tp_shards=1))
    config, caches = allocate([good])
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=config.kv_cache_tensors,
        kv_cache_groups=[good, group],
    )
    caches.update(bad_caches)
    rng = np.random.default_rng(16)
    kv = ref.random_kv(rng, 1, 20, 2, 16)
    ref.fill_caches({name(0): caches[name(0)]}, 5)
    ref.scatter_kv(kv, caches, {name(0): 0}, [0, 1], [4, 2], 16, NUM_BLOCKS)
    worker = make_worker(
        config,
        caches,
        tp_rank=0,
        tp_size=topo.get("tp_size", 1),
        model_heads=topo.get("model_heads", 2),
    )
    assert worker.skipped_groups == (1,)
    assert set(worker.fingerprints) == {0}
    messages = [r.getMessage() for r in vllm_caplog.records]
    logged = [m for m in messages if m.startswith("KV cache group 1 is not covered")]
    assert len(logged) == 1, messages
    assert reason in logged[0] and logged[0].endswith(".")
    assert not any("KV cache group 0" in m for m in messages)
    record = send(worker, {REQ: blocks(20, (0, 0, [4, 2]), (1, 0, [5, 6]))})
    assert record.skipped_groups == (1,)
    assert set(record.checksums[REQ]) == {0}
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)


# --------------------------------------------------------------------------
# Lifecycle (R47-R51)
# --------------------------------------------------------------------------


@pytest.fixture
def lifecycle():
    """A TP1 worker with one request's truth in blocks [2, 5]: (worker, truth)."""
    rng = np.random.default_rng(17)
    kv = ref.random_kv(rng, 2, 28, 2, 16)
    return truth_worker(kv, [2, 5]), ref.reference_block_checksums(kv, 16)


def _scheduled(kind: str, reqs: dict) -> KVChecksumScheduled:
    return KVChecksumScheduled(**{f"reqs_to_{kind}": reqs})


@pytest.mark.parametrize("kind", ["recv", "load"])
def test_load_finished_then_forgotten(lifecycle, kind):
    """R47/R48: a load is checksummed in the step reporting it finished, then
    forgotten; receives accumulate over steps until then.

    Catches loads checksummed before they finish (blocks not yet written) or
    checksummed again on a repeated report."""
    worker, want = lifecycle
    other = blocks(28, (0, 1, [5]))
    worker.bind(_scheduled(kind, {REQ: blocks(28, (0, 0, [2, 5]))}))
    assert worker.post_forward(finished_recving=set()) is None
    worker.bind(_scheduled(kind, {"req-1": other}))  # accumulates
    worker.bind(None)  # a no-forward step binds nothing new
    record = worker.post_forward(finished_recving={REQ}).finalize()
    assert set(record.checksums) == {REQ}
    group = record.checksums[REQ][0]
    assert (group.start, hexes(group.values[:, 0])) == (0, hexes(want))
    assert worker.post_forward(finished_recving={REQ}) is None
    record = worker.post_forward(finished_recving={"req-1"}).finalize()
    group = record.checksums["req-1"][0]
    assert (group.start, hexes(group.values[:, 0])) == (1, hexes(want[1:]))


@pytest.mark.parametrize("kind", ["recv", "load"])
@pytest.mark.parametrize("also_finished", [True, False])
def test_failed_load_dropped(lifecycle, kind, also_finished):
    """R48/R75: a load in failed_recving is not checksummed and is dropped.

    Catches failed loads compared (false mismatches on known-bad KV) or kept
    until a later report checksums them."""
    worker, _ = lifecycle
    worker.bind(_scheduled(kind, {REQ: blocks(28, (0, 0, [2, 5]))}))
    finished = {REQ} if also_finished else set()
    assert worker.post_forward(finished_recving=finished, failed_recving={REQ}) is None
    assert worker.post_forward(finished_recving={REQ}) is None


@pytest.mark.parametrize("kind", ["recv", "load"])
def test_abort_while_loading_dropped(lifecycle, kind):
    """R48/R75: a request finished (aborted) while loading is dropped; a later
    finished_recving for it yields nothing.

    Catches checksumming freed blocks of aborted requests."""
    worker, _ = lifecycle
    worker.bind(_scheduled(kind, {REQ: blocks(28, (0, 0, [2, 5]))}))
    assert worker.post_forward(finished_recving=(), finished_req_ids={REQ}) is None
    assert worker.post_forward(finished_recving={REQ}) is None


def test_sends_replaced_and_cleared(lifecycle):
    """R47/R48: sends of a bind replace the previous ones; bind(None) clears
    them; post_forward clears them.

    Catches sends checksummed again in later steps (after blocks are reused)."""
    worker, want = lifecycle
    worker.bind(_scheduled("send", {"old": blocks(28, (0, 0, [2, 5]))}))
    worker.bind(None)
    assert worker.post_forward(finished_recving=()) is None
    worker.bind(_scheduled("send", {"old": blocks(28, (0, 0, [2, 5]))}))
    worker.bind(_scheduled("send", {REQ: blocks(28, (0, 0, [2, 5]))}))
    record = worker.post_forward(finished_recving=()).finalize()
    assert set(record.checksums) == {REQ}
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)
    assert worker.post_forward(finished_recving=()) is None


def test_every_requested_request_in_record():
    """R51: every request asked for appears in the record, even with no
    checksummed group (here: only a skipped group, or no group entry).

    Catches the scheduler waiting forever / counting a worker as missing."""
    good = KVCacheGroupSpec([name(0)], attn(2))
    bad = KVCacheGroupSpec([name(1)], attn(2), host_resident=True)
    config, caches = allocate([good, bad], skip=[name(1)])
    worker = make_worker(config, caches)
    record = send(
        worker,
        {"only-skipped": blocks(16, (1, 0, [1])), "no-groups": blocks(16)},
    )
    assert record.checksums == {"only-skipped": {}, "no-groups": {}}
    assert record.skipped_groups == (1,)
    assert record.fingerprints == worker.fingerprints


@pytest.mark.parametrize("tp_rank, pp_rank", [(0, 0), (1, 0), (0, 1)])
def test_received_only_on_first_worker(tp_rank, pp_rank):
    """R50: only the (pp 0, tp 0) worker puts received producer bytes in its record.

    Catches W copies of the payload shipped per step (and decoded W times)."""
    spec = attn(1)
    config, caches = allocate([KVCacheGroupSpec([name(pp_rank)], spec)])
    worker = make_worker(config, caches, tp_rank, 2, pp_rank, model_heads=2)
    worker.bind(_scheduled("recv", {REQ: blocks(16, (0, 0, [1]))}))
    pending = worker.post_forward(
        finished_recving={REQ}, failed_recving=set(), received={REQ: b"\x01payload"}
    )
    record = pending.finalize()
    first = (tp_rank, pp_rank) == (0, 0)
    assert record.received == ({REQ: b"\x01payload"} if first else {})
    assert set(record.checksums) == {REQ}
    # Received bytes alone make a record only on the first worker.
    alone = worker.post_forward(finished_recving=(), received={"r2": b"x"})
    if first:
        assert alone is not None and alone.finalize().received == {"r2": b"x"}
        assert alone.finalize().checksums == {}
    else:
        assert alone is None


def test_side_stream_copy_without_host_sync(lifecycle, cuda_stream_stubs):
    """R55: results are copied on the worker's side stream, which first waits for
    the compute stream (an event recorded there this step, then waited on); an
    event recorded after the copy is waited on only in finalize.

    Catches a host synchronization in the engine step, a copy not ordered
    after the checksum kernels, and (issue 30: one ordering event for good)
    the side stream waiting before this step's record (on the last step's
    kernels only)."""
    worker, want = lifecycle
    state = cuda_stream_stubs
    compute = state.current
    pending = send(worker, {REQ: blocks(28, (0, 0, [2, 5]))})  # finalized
    assert hexes(pending.checksums[REQ][0].values[:, 0]) == hexes(want)
    side = [s for s in state.created_streams if s is not compute]
    assert len(side) == 1  # one side stream, reused across steps
    order: list[tuple[str, object]] = []
    ordering = worker.launcher._compute_done
    record, wait = ordering.record, side[0].wait_event
    ordering.record = lambda stream=None: (
        order.append(("record", stream)) or record(stream)
    )
    side[0].wait_event = lambda event: order.append(("wait", event)) or wait(event)
    waits = {id(e): e.num_synchronize for e in state.created_events}
    worker.bind(_scheduled("send", {REQ: blocks(28, (0, 0, [2, 5]))}))
    pending = worker.post_forward(finished_recving=())
    assert order == [("record", compute), ("wait", ordering)]
    assert len(state.created_streams) == 1  # one side stream, reused
    event = pending.event
    assert event.recorded_on[-1] is side[0]
    # No wait in the step (the event may be one reused, waited on before).
    assert event.num_synchronize == waits.get(id(event), 0)
    assert compute.num_synchronize == 0
    assert state.current is compute  # the stream context was left
    record = pending.finalize()
    assert event.num_synchronize == waits.get(id(event), 0) + 1
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)


def test_R55_side_copy_holds_its_device_run_and_reuses_waited_events(
    lifecycle, cuda_stream_stubs
):
    """R55, issue 30 (driver calls per step): a record holds the device run its
    side-stream copy reads until `finalize` waited for the copy (what
    `record_stream` guarded: the allocator handing that memory to the next
    kernels mid-copy), then lets it go; a waited-for event goes back to the
    launcher and the next step records it again, while an event still
    unwaited is never handed out twice. Bugs caught: the run dropped at the
    step's end (a read of reused memory), an event reused before its reader
    waited (finalize would wait for a later step's copy), events never
    reused (a create and a destroy every step)."""
    worker, want = lifecycle
    worker.bind(_scheduled("send", {REQ: blocks(28, (0, 0, [2, 5]))}))
    first = worker.post_forward(finished_recving=())
    assert first.device_run is not None
    run, result = first.device_run, first.results[0].device
    assert run.untyped_storage().data_ptr() == result.untyped_storage().data_ptr()
    worker.bind(_scheduled("send", {REQ: blocks(28, (0, 0, [2, 5]))}))
    second = worker.post_forward(finished_recving=())
    assert second.event is not first.event  # first's reader has not waited
    first_event = first.event
    record = first.finalize()
    assert first.device_run is None and first.event is None
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)
    worker.bind(_scheduled("send", {REQ: blocks(28, (0, 0, [2, 5]))}))
    third = worker.post_forward(finished_recving=())
    assert third.event is first_event  # waited for, so reused
    assert hexes(third.finalize().checksums[REQ][0].values[:, 0]) == hexes(want)
    assert hexes(second.finalize().checksums[REQ][0].values[:, 0]) == hexes(want)


@pytest.mark.parametrize("index", [1, None])
def test_R55_side_copy_reads_the_workers_device_stream(
    monkeypatch: pytest.MonkeyPatch, index: int | None
) -> None:
    """R55, issue 30 (the side copy's stream calls): on a CUDA worker the side
    stream is made on the worker's own device, and the copy asks the
    accelerator API for the current stream of that device index (for a bare
    "cuda", the device current at the first copy) and sets streams through
    it; elsewhere `torch.cuda`'s functions stay (what vLLM's CPU worker
    stubs). Bugs caught (tried): a bare device read as index 0, and the side
    stream made on the current device instead of the worker's (on a worker
    of GPU 1 the side stream would wait on GPU 0's stream and copy results
    its kernels had not written yet)."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.launches import (
        ChecksumLauncher,
    )

    asked: list[int] = []
    made: list[object] = []
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    monkeypatch.setattr(
        torch.accelerator, "current_stream", lambda i: asked.append(i) or f"s{i}"
    )
    monkeypatch.setattr(
        torch.cuda, "Stream", lambda device=None: made.append(device) or "side"
    )
    device = torch.device("cuda", index) if index is not None else torch.device("cuda")
    topology = WorkerTopology(0, 1, 0, 4, 2, device)
    launcher = ChecksumLauncher({}, topology, None)  # type: ignore[arg-type]
    streams = launcher._side_streams()
    assert streams.side == "side" and made == [1] and streams.device_index == 1
    assert streams.current() == "s1" and asked == [1]
    assert streams.set_current is torch.accelerator.set_stream
    cpu = WorkerTopology(0, 1, 0, 4, 2, torch.device("cpu"))
    launcher = ChecksumLauncher({}, cpu, None)  # type: ignore[arg-type]
    streams = launcher._side_streams()
    assert streams.current is torch.cuda.current_stream
    assert streams.device_index is None
    assert streams.set_current is torch.cuda.set_stream


def test_R55_side_copy_restores_the_compute_stream_on_error(
    lifecycle, cuda_stream_stubs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R55: a copy that raises leaves the compute stream current, so vLLM's
    next kernels do not run on the checksum side stream. Bug caught
    (tried): the compute stream set back after the copy, not in `finally`."""
    worker, _ = lifecycle
    state = cuda_stream_stubs
    compute = state.current

    class FailingBuffer:
        def copy_(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("copy failed")

    monkeypatch.setattr(torch, "empty", lambda *a, **k: FailingBuffer())
    with pytest.raises(RuntimeError, match="copy failed"):
        worker.launcher._copy_on_side_stream(torch.zeros(4, dtype=torch.int64))
    assert state.current is compute


def test_R55_one_host_buffer_per_step(lifecycle, cuda_stream_stubs):
    """R55, issue 30 (host work per step): a step's results, checksums and stored
    entries of every pass, land in one host buffer by one copy on the side
    stream, each at its own place. Bug caught (tried): the stored entries
    placed over the checksums (both views at offset 0 of the buffer)."""
    worker, want = lifecycle
    worker.init_block_checksums([0])
    assert worker.block_table.tensor is not None
    worker.block_table.tensor[2], worker.block_table.tensor[5] = 11, -22
    worker.bind(_scheduled("load", {REQ: blocks(28, (0, 0, [2, 5]))}))
    worker.bind(_scheduled("send", {"r2": blocks(28, (0, 0, [2, 5]))}))
    pending = worker.post_forward(finished_recving={REQ}, failed_recving=set())
    spans = [(r.host_at, r.device.numel()) for r in pending.results]
    spans += [
        (r.stored_at, r.stored_device.numel())
        for r in pending.results
        if r.stored_device is not None
    ]
    assert len(pending.results) == 2 and len(spans) == 3
    assert pending.host is not None and pending.host.dim() == 1
    # Three disjoint places inside the one host buffer.
    ends = sorted((at, at + n) for at, n in spans)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] <= pending.host.numel()
    record = pending.finalize()
    assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)
    assert hexes(record.checksums["r2"][0].values[:, 0]) == hexes(want)
    stored = record.checksums[REQ][0].stored
    assert stored is not None and stored.view(np.int64).tolist() == [11, -22]


# --------------------------------------------------------------------------
# Fingerprints and records (R42, R54)
# --------------------------------------------------------------------------


def _fingerprint(layers, dtype=torch.float16, tp_rank=0, tp_size=1, pp_rank=0):
    spec = attn(4 // tp_size, dtype=dtype)
    config, caches = allocate([KVCacheGroupSpec([name(i) for i in layers], spec)])
    worker = make_worker(config, caches, tp_rank, tp_size, pp_rank, 4)
    return worker.fingerprints[0]


def test_fingerprints_pp_independent_and_distinct():
    """R42/R87: stage fingerprints sum to the PP1 value; equal across TP ranks;
    another dtype or layer set gives another value.

    Catches fingerprints of one stage only, or identities missing dtype/name."""
    whole = _fingerprint(range(4))
    stages = [_fingerprint([0, 1], pp_rank=0), _fingerprint([2, 3], pp_rank=1)]
    assert (sum(stages) & ref.MASK64) == whole
    three = [_fingerprint([0]), _fingerprint([1, 2]), _fingerprint([3])]
    assert (sum(three) & ref.MASK64) == whole
    assert {_fingerprint(range(4), tp_rank=r, tp_size=2) for r in range(2)} == {whole}
    assert _fingerprint(range(4), dtype=torch.bfloat16) != whole
    assert _fingerprint(range(3)) != whole
    assert _fingerprint([0, 1, 2, 5]) != whole


def test_record_pickle_round_trip():
    """R54: a finalized record survives pickling (it is serialized to the
    scheduler) with its values, keys, skipped groups, fingerprints, received.

    Catches records holding tensors, streams or events (unpicklable, or device
    memory shipped)."""
    rng = np.random.default_rng(18)
    kv = ref.random_kv(rng, 2, 30, 2, 16)
    worker = truth_worker(kv, [0, 3], tp_rank=0, tp_size=4)
    worker.bind(KVChecksumScheduled(reqs_to_send={REQ: blocks(30, (0, 0, [0, 3]))}))
    pending = worker.post_forward(finished_recving=(), received={"x": b"abc"})
    record = pending.finalize()
    assert pending.finalize() is record
    copy = pickle.loads(pickle.dumps(record))
    assert isinstance(copy, KVChecksumRecord)
    assert (copy.pp_rank, copy.tp_rank) == (0, 0)
    assert copy.skipped_groups == record.skipped_groups
    assert copy.fingerprints == record.fingerprints
    assert copy.received == {"x": b"abc"}
    group, original = copy.checksums[REQ][0], record.checksums[REQ][0]
    assert group.start == original.start
    assert group.replica_keys == original.replica_keys == ((1, 0),)
    assert group.values.dtype == np.uint64 and group.values.shape == (2, 1)
    assert np.array_equal(group.values, original.values)
    assert group.stored is None


# --------------------------------------------------------------------------
# Rows (R52) and chunked gathers (R63)
# --------------------------------------------------------------------------


def test_segment_rows_and_even_columns():
    """R52: rows are (block id, (start + i) * bs, clamp(N - first, 0, bs)) and
    every segment starts at an even column.

    Catches rows without the per-request start and misaligned segments."""
    reqs = [
        ("a", blocks(40, (0, 0, [7, 8, 9]))),
        ("b", blocks(70, (0, 2, [3, 4]), (1, 1, [5]))),
        ("c", blocks(10, (1, 0, [6]))),
    ]
    req_ids, starts, counts, rows = segment_rows(reqs, 0, 16)
    assert req_ids == ("a", "b")
    assert starts.tolist() == [0, 2] and counts.tolist() == [3, 2]
    assert rows.tolist() == [
        [7, 8, 9, 3, 4],
        [0, 16, 32, 32, 48],
        [16, 16, 8, 16, 16],
    ]
    ids1, _, _, rows1 = segment_rows(reqs, 1, 32)
    assert ids1 == ("b", "c") and rows1.tolist() == [[5, 6], [32, 0], [32, 10]]
    empty = segment_rows(reqs, 2, 16)
    assert empty[0] == () and empty[3].shape == (3, 0)
    packed, columns = pack_segments([rows, rows1, rows])
    assert columns == [0, 6, 8]
    assert packed.shape == (3, 14)
    assert packed[:, 5].tolist() == [0, 0, 0]  # padding: masked block-0 row
    assert np.array_equal(packed[:, 6:8], rows1)


def _rows_by_block(reqs, group_id: int, block_size: int):
    """segment_rows' output, block by block in plain Python (the reference):
    (req ids, starts, counts, rows as lists)."""
    req_ids, starts, counts = [], [], []
    rows: list[list[int]] = [[], [], []]
    for req_id, b in reqs:
        if group_id not in b.groups:
            continue
        start, ids = b.groups[group_id]
        req_ids.append(req_id)
        starts.append(int(start))
        counts.append(len(ids))
        for i, block_id in enumerate(ids):
            first = (start + i) * block_size
            rows[0].append(int(block_id))
            rows[1].append(int(first))
            rows[2].append(int(min(max(b.num_tokens - first, 0), block_size)))
    return tuple(req_ids), starts, counts, rows


def _check_segment_rows(reqs, group_id: int = 0, block_size: int = 16) -> None:
    """segment_rows against the reference, every output."""
    req_ids, starts, counts, rows = segment_rows(reqs, group_id, block_size)
    want_ids, want_starts, want_counts, want_rows = _rows_by_block(
        reqs, group_id, block_size
    )
    assert req_ids == want_ids
    assert starts.tolist() == want_starts and counts.tolist() == want_counts
    assert rows.shape == (3, sum(want_counts)) and rows.tolist() == want_rows
    assert rows.dtype == starts.dtype == counts.dtype == np.int64


def test_R52_segment_rows_one_request_and_many_match_a_block_loop():
    """R52, issue 30 (one request takes its own shorter path): rows, request
    ids, starts and counts of one request and of several, against a
    block-by-block reference, with blocks past the request's end (0 valid
    tokens), starts > 0, an empty block list, and several requests of which
    one has the group (the one-request path again).

    Catches (tried): the one-request path without its start, and valid
    counts clipped only from above (negative counts past the end)."""
    one = [("a", blocks(70, (0, 2, [3, 4, 5, 6])))]
    req_ids, starts, counts, rows = segment_rows(one, 0, 16)
    assert req_ids == ("a",) and starts.tolist() == [2] and counts.tolist() == [4]
    assert rows.tolist() == [[3, 4, 5, 6], [32, 48, 64, 80], [16, 16, 6, 0]]
    _check_segment_rows([("a", blocks(70, (0, 3, [])))])
    _check_segment_rows(
        [
            ("a", blocks(40, (1, 0, [9]))),
            ("b", blocks(70, (0, 1, [3, 4, 5]))),
            ("c", blocks(10, (1, 0, [6]))),
        ]
    )
    rng = np.random.default_rng(7)
    for n in (1, 1, 2, 5):
        reqs = []
        for k in range(n):
            count = int(rng.integers(0, 6))
            start = int(rng.integers(0, 4))
            ids = rng.integers(0, 100, count).tolist()
            tokens = int(rng.integers(0, (start + count + 1) * 16))
            reqs.append((f"r{k}", blocks(tokens, (0, start, ids))))
        _check_segment_rows(reqs)


def test_multi_request_multi_group_rows():
    """R52/R54: several requests and groups in one step, loads and sends as
    separate passes; odd first group so the second starts at an even column;
    loads starting past the first block; partial last blocks.

    Catches rows without the per-request start (loads from the first block),
    segments written to the wrong columns, or requests' rows interleaved."""
    rng = np.random.default_rng(19)
    nb = 24
    g0_names, g1_names = [name(0), name(1)], [name(2), name(3)]
    g0 = KVCacheGroupSpec(g0_names, attn(2))
    g1 = KVCacheGroupSpec(
        g1_names, attn(2, 32, cls=SlidingWindowSpec, sliding_window=64)
    )
    config, caches = allocate([g0, g1], num_blocks=nb)
    ref.fill_caches(caches, 6)
    worker = make_worker(config, caches)
    # request -> (num tokens, g0 start, g0 ids, g1 start, g1 ids); g0 bs 16, g1 32
    plan = {
        "load-a": (45, 0, [0, 1, 2], 0, [3, 4]),
        "load-b": (70, 2, [5, 6, 7], 1, [8, 9]),
        "send-c": (20, 0, [10, 11], 0, [12]),
    }
    truths = {}
    for req, (n, s0, ids0, s1, ids1) in plan.items():
        kv = ref.random_kv(rng, 4, n, 2, 16)
        truths[req] = kv
        # Only the loaded (or sent) blocks are written: positions before the
        # start are the consumer's own prefix, which the worker must not read.
        ref.scatter_kv(
            kv[:2],
            caches,
            {g0_names[0]: 0, g0_names[1]: 1},
            [0, 1],
            [None] * s0 + ids0,
            16,
            nb,
        )
        ref.scatter_kv(
            kv[2:],
            caches,
            {g1_names[0]: 0, g1_names[1]: 1},
            [0, 1],
            [None] * s1 + ids1,
            32,
            nb,
        )
    sched = {
        req: blocks(n, (0, s0, ids0), (1, s1, ids1))
        for req, (n, s0, ids0, s1, ids1) in plan.items()
    }
    worker.bind(
        KVChecksumScheduled(
            reqs_to_send={"send-c": sched["send-c"]},
            reqs_to_recv={"load-a": sched["load-a"]},
            reqs_to_load={"load-b": sched["load-b"]},
        )
    )
    record = worker.post_forward(finished_recving={"load-a", "load-b"}).finalize()
    assert set(record.checksums) == set(plan)
    for req, (n, s0, ids0, s1, ids1) in plan.items():
        kv = truths[req]
        for gid, start, ids, layers, bs in (
            (0, s0, ids0, [0, 1], 16),
            (1, s1, ids1, [2, 3], 32),
        ):
            group = record.checksums[req][gid]
            # P/D sends and receives report 16-token chunks (R135), an
            # offloaded-KV load ("load-b") whole blocks.
            unit = bs if req == "load-b" else 16
            per = bs // unit
            want = ref.reference_block_checksums(kv[layers], unit, n, layers)
            want = np.append(want, np.zeros(len(ids) * per, dtype=U64))
            want = want[start * per : (start + len(ids)) * per]
            assert group.start == start * per
            assert hexes(group.values[:, 0]) == hexes(want), (req, gid)


def test_chunked_gathers_equal_unchunked(monkeypatch):
    """R27/R63: gathering blocks in small chunks gives the unchunked values.

    Catches chunk offsets into rows or output columns off by a chunk."""
    rng = np.random.default_rng(20)
    kv = ref.random_kv(rng, 3, 100, 2, 16)
    ids = [7, 1, 0, 5, 3, 2, 6]
    whole = _values(kv, ids, 100)
    for limit in (1, 1024, 3 * 1024):  # 512-byte blocks: 1, 2 and 6 per chunk
        monkeypatch.setattr(kernels, "GATHER_CHUNK_BYTES", limit)
        assert hexes(_values(kv, ids, 100)) == hexes(whole)
    assert hexes(whole) == hexes(ref.reference_block_checksums(kv, 16))


def test_hashlib_reference_fingerprint_is_sha256():
    """R42: the reference fingerprint is the low 8 bytes of SHA-256 of repr().

    Guards the reference itself against drift."""
    identity = ("model.layers.0.self_attn.attn", "FullAttentionSpec", "torch.bfloat16")
    digest = hashlib.sha256(repr(identity).encode()).digest()
    assert int.from_bytes(digest[:8], "little") == FP_LAYER0
