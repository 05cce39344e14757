# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The producer-finish benchmark measures what it says (issue 30, R142).

It times `request_finished` with and without the freed-block scan on the
same inputs; both must send the payload the reported sums make.
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    chunk_tokens,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import (
    producer as producer_module,
)
from vllm.distributed.kv_transfer.kv_checksum.wire import payload as payload_module
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
)

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_producer_finish.py"
)


def test_both_modes_send_the_reported_sums() -> None:
    """R74, R142: in both modes each finished producer sends one value per
    16-token block, the worker's reported value (position + step + 1), from
    position 0. Bugs caught: a mode that times requests sending nothing (a
    not-finished status, a missing carrier), or payloads of the other step."""
    bench = load_script("_producer_finish_bench", SCRIPT)
    for name, hold in bench.MODES.items():
        kcs = bench._scheduler(hold)
        manager = bench._BlockManager()
        _, params = bench.finish_step(kcs, manager, 3, num_requests=2, num_blocks=5)
        assert len(params) == 2, name
        for p in params:
            payload = KVChecksumPayload.from_base64(p[KV_TRANSFER_PARAMS_KEY])
            (group,) = payload.groups
            assert (group.start, payload.num_tokens) == (0, 80)
            assert np.array_equal(group.values, np.arange(5, dtype=np.uint64) + 4)
        assert manager.blocks == {}
    result = bench.run(num_requests=2, num_blocks=4, rounds=1, steps=2)
    assert set(result["us_per_request"]) == set(bench.MODES)


def test_compare_times_the_reference_and_current_paths_on_equal_payloads() -> None:
    """R74, R77, R142: `--compare` runs the finish path of f2303ef (the
    benchmark's `_ReferenceProducer`) and the package's current one on the
    same inputs; both send the reported sums as the same base64 payload, and
    the result has a before and after figure per group kind. Bugs caught: a
    reference that is not the old path (the package's producer timed twice),
    or a current path whose payload bytes differ from the old one's (the
    comparison in `run_compare` asserts equal params every step)."""
    bench = load_script("_producer_finish_bench_compare", SCRIPT)
    for hold in bench.KINDS.values():
        sent = []
        for reference in (True, False):
            kcs = bench._scheduler(hold, reference)
            assert isinstance(kcs.producer, bench._ReferenceProducer) is reference
            _, params = bench.finish_step(
                kcs, bench._BlockManager(), 2, num_requests=2, num_blocks=3
            )
            sent.append(params)
        assert sent[0] == sent[1]
        for p in sent[0]:
            payload = KVChecksumPayload.from_base64(p[KV_TRANSFER_PARAMS_KEY])
            (group,) = payload.groups
            assert np.array_equal(group.values, np.arange(3, dtype=np.uint64) + 3)
    result = bench.run_compare(num_requests=2, num_blocks=4, rounds=1, steps=2)
    assert set(result["us_per_request"]) == set(bench.KINDS)
    for paths in result["us_per_request"].values():
        assert set(paths) == set(bench.PATHS) and all(v > 0 for v in paths.values())


def test_reference_pieces_swap_the_old_versions_in_and_restore_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R142: inside `reference_pieces` the producer module calls the f2303ef
    helpers, `KVChecksumPayload.to_bytes` its old check and buffer, and the group info's
    properties are computed on every read even over a value cached in the
    instance; on leaving, also by an exception, every piece is the package's
    again; `finish_step` enters it for the reference producer only.

    Bugs caught: a swap of a name the producer does not look up (the
    package's path timed twice), a swap left in place after a step (the
    current path timed on the old code), or a reference step run outside it.
    """
    bench = load_script("_producer_finish_bench_pieces", SCRIPT)
    pieces = bench._REFERENCE_PIECES
    originals = [vars(owner)[name] for owner, name, _ in pieces]
    info = KVChecksumGroupInfo(16)
    info.__dict__.update(chunk_tokens=999, chunks_per_block=999)  # stale caches
    with bench.reference_pieces():
        assert producer_module.build_producer_payload is (
            bench._ref_build_producer_payload
        )
        assert producer_module.first_held_position is bench._ref_first_held_position
        assert producer_module._finished_normally is bench._ref_finished_normally
        assert payload_module._check_encodable is bench._ref_check_encodable
        assert payload_module._values_buffer is bench._ref_values_buffer
        chunk = chunk_tokens(16)
        assert (info.chunk_tokens, info.chunks_per_block) == (chunk, 16 // chunk)
    assert (info.chunk_tokens, info.chunks_per_block) == (999, 999)
    assert all(vars(o)[n] is v for (o, n, _), v in zip(pieces, originals))
    with pytest.raises(RuntimeError), bench.reference_pieces():
        raise RuntimeError
    assert all(vars(o)[n] is v for (o, n, _), v in zip(pieces, originals))

    entered = []
    swap = bench.reference_pieces

    @contextlib.contextmanager
    def spy() -> Iterator[None]:
        with swap():
            entered.append(producer_module.build_producer_payload)
            yield

    monkeypatch.setattr(bench, "reference_pieces", spy)
    for reference in (True, False):
        kcs = bench._scheduler(True, reference)
        bench.finish_step(kcs, bench._BlockManager(), 0, num_requests=1, num_blocks=2)
    assert entered == [bench._ref_build_producer_payload]
