# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mooncake P2P as a CONNECTOR carrier (R110-R115), on CPU.

Producer and consumer are real vLLM Schedulers with MooncakeConnector's
scheduler side (producer and consumer roles) and simulated checksum workers
(`kv_checksum_pd.SimEngine`). The transfer side is vLLM's
MooncakeConnectorWorker built without Mooncake (`bare_worker`): its methods
run for real; responses go through its real msgpack encoder and decoder. On
vLLM 0.33.0 the plugin's hooks carry the checksums; on a vLLM with the
in-tree series (its Mooncake commit) vLLM's own code does, and the same tests
run against it (`bare_worker`, `respond` and `response_class` are the only
calls that differ).
"""

import asyncio
import base64
import hashlib
import logging
import queue
import tracemalloc
from typing import Any

import msgspec
import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    GroupsKind,
    make_kv_cache_config,
    make_request,
    native_kv_checksums,
    register_plugin,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    Fault,
    SideConfig,
    SimEngine,
    apply_fault,
    capture_verdicts,
    deliver_next,
    per_group,
    transfer,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import package_state as harness_state
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import KVChecksumStatus
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.kv_checksum_capability("mooncake")

MOONCAKE = "MooncakeConnector"
MAX_BYTES = 1 << 20


def mc_module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
        mooncake_connector,
    )

    return mooncake_connector


def child_meta(meta: Any) -> Any:
    """The Mooncake metadata, inside a MultiConnector's if there is one."""
    return getattr(meta, "metadata", (meta,))[0]


def mooncake_connector(engine: SimEngine) -> Any:
    connector = engine.scheduler.connector
    return getattr(connector, "_connectors", [connector])[0]


def mooncake_engine(
    model_dir: str, name: str, producer: bool, groups: GroupsKind = "full"
) -> SimEngine:
    engine = SimEngine(model_dir, SideConfig(connector=MOONCAKE, groups=groups), name)
    sched = mooncake_connector(engine).connector_scheduler
    sched.is_kv_producer, sched.is_kv_consumer = producer, not producer
    return engine


class Stopped:
    """A stopped loop, executor and ZMQ context in one."""

    def term(self) -> None:
        return None

    def shutdown(self, wait: bool = True) -> None:
        return None

    def is_running(self) -> bool:
        return False


def bare_worker(vllm_config: Any, producer: bool, kv_cache_config: Any = None) -> Any:
    """vLLM's MooncakeConnectorWorker without Mooncake, checksums on as at
    start-up: the plugin's registration on vLLM 0.33.0 (inside the worker's
    KVCacheConfig context when `kv_cache_config` is given), the worker's own
    set-up in the series (with `kv_cache_config`, else the engine's)."""
    mc = mc_module()
    worker = mc.MooncakeConnectorWorker.__new__(mc.MooncakeConnectorWorker)
    worker._encoder = msgspec.msgpack.Encoder()
    worker._xfer_resp_decoder = msgspec.msgpack.Decoder(mc.MooncakeXferResponse)
    # A producer also claims the consumer role so that vLLM's start_load_kv
    # schedules nothing on its (never started) sender loop.
    worker.is_kv_producer, worker.is_kv_consumer = producer, True
    worker.finished_recving_reqs = set()
    worker._failed_recv_reqs = queue.Queue()
    # What vLLM's shutdown (run by __del__) touches: stopped stand-ins.
    worker.vllm_config = vllm_config
    stopped = Stopped()
    worker.async_zmq_ctx = worker._sender_executor = stopped
    worker.sender_loop = worker.receiver_loop = stopped
    if native_kv_checksums():
        config = kv_cache_config or make_kv_cache_config(vllm_config)
        worker._init_kv_checksums(vllm_config, config)
        return worker
    from vllm.distributed.kv_transfer.kv_checksum import wiring
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (
        mooncake as wiring_mooncake,
    )

    token = wiring._kv_cache_config.set(kv_cache_config)
    try:
        wiring_mooncake._attach_mooncake_worker(
            worker, vllm_config, mc.MooncakeXferResponse
        )
    finally:
        wiring._kv_cache_config.reset(token)
    return worker


def response_class() -> Any:
    """The transfer response type with `kv_checksums`: vLLM's own in the
    series, the plugin's extension of it on vLLM 0.33.0."""
    mc = mc_module()
    if native_kv_checksums():
        return mc.MooncakeXferResponse
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (
        mooncake as wiring_mooncake,
    )

    return wiring_mooncake.response_type(mc.MooncakeXferResponse)


def package_state(engine: SimEngine) -> int:
    """Entries in the package's per-request dictionaries of one engine."""
    return harness_state(engine, mooncake_connector(engine).connector_scheduler)


def worker_state(*workers: Any) -> int:
    total = 0
    for w in workers:
        send, received = w._kv_checksum_send, w._kv_checksum_received
        total += len(send.by_transfer) + len(send.transfer_of)
        total += len(received.by_request)
    return total


def respond(p_worker: Any, d_req_blocks: dict, ok: list, err: list) -> bytes:
    """The producer worker's transfer response for one pull (R112)."""
    mc = mc_module()
    response = mc.MooncakeXferResponse(
        status=mc.MooncakeXferResponseStatus.FINISH,
        ok_reqs=ok or None,
        err_reqs=err or None,
        err_msg="failed" if err else None,
    )
    if native_kv_checksums():  # what send_kv_to_decode does with it
        if ok and p_worker._kv_checksum_send is not None:
            p_worker._add_kv_checksums(response, d_req_blocks)
        return p_worker._encoder.encode(response)
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (
        mooncake as wiring_mooncake,
    )

    token = wiring_mooncake.CURRENT_PULL.set(d_req_blocks)
    try:
        return p_worker._encoder.encode(response)
    finally:
        wiring_mooncake.CURRENT_PULL.reset(token)


def run_pd(
    producer: SimEngine,
    consumer: SimEngine,
    workers: tuple[Any, Any],
    idx: int,
    *,
    corrupt: bool = False,
    order: str = "payload_with_kv",
    duplicate: bool = False,
    old_producer: bool = False,
) -> Any:
    """One P/D load over Mooncake; returns the consumer's verdict.

    `order`: "payload_with_kv" (the response arrives, then the worker reports
    the load finished, as Mooncake does) or "finished_later" (the response is
    processed several engine steps before get_transfer_results reports it).
    """
    p_worker, d_worker = workers
    prompt = [(idx * 5 + i) % 50 + 1 for i in range(37)]
    prod_id, cons_id, tid = f"p{idx}", f"c{idx}", f"t{idx}"
    producer.add(
        make_request(
            prod_id,
            prompt,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": tid},
        )
    )
    producer.run(prod_id)
    meta_p = child_meta(producer.step().kv_connector_metadata)
    assert meta_p.reqs_to_send[prod_id][0] == tid
    p_worker.start_load_kv(meta_p)
    verdicts = capture_verdicts(consumer)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_bootstrap_addr": "http://p",
        "transfer_id": tid,
    }
    consumer.add(make_request(cons_id, prompt, max_tokens=2, kv_transfer_params=params))
    meta_c = child_meta(consumer.step().kv_connector_metadata)
    assert consumer.scheduler.requests[cons_id].status == (
        RequestStatus.WAITING_FOR_REMOTE_KVS
    )
    pull_meta = meta_c.reqs_to_recv["P"][cons_id]
    end = consumer.scheduler.requests[cons_id].num_computed_tokens
    copied = transfer(
        producer,
        per_group(meta_p.reqs_to_send[prod_id][1]),
        consumer,
        consumer.block_ids(cons_id),
        list(range(end)),
    )
    if corrupt:
        apply_fault(
            consumer,
            consumer.block_ids(cons_id)[0],
            copied[0],
            Fault("bit_flip", position=1),
        )
    req_blocks = {cons_id: (tid, pull_meta.local_block_ids)}
    wire = respond(p_worker, req_blocks, [cons_id], [])
    if old_producer:  # a peer without the package: vLLM's plain response
        mc = mc_module()
        wire = msgspec.msgpack.encode(
            mc.MooncakeXferResponse(
                status=mc.MooncakeXferResponseStatus.FINISH, ok_reqs=[cons_id]
            )
        )
    pulls = {cons_id: pull_meta}
    pull_meta.pull_tasks_count = 2 if duplicate else 1
    d_worker.process_pulling_result(d_worker._xfer_resp_decoder.decode(wire), pulls)
    if duplicate:  # heterogeneous TP: a second producer rank answers too,
        # here with different bytes: only the first copy may count.
        mc = mc_module()
        raw = d_worker._xfer_resp_decoder.decode(wire).kv_checksums
        first = msgspec.msgpack.decode(raw, type=dict[str, bytes])[cons_id]
        other = msgspec.msgpack.encode(
            response_class()(
                status=mc.MooncakeXferResponseStatus.FINISH,
                ok_reqs=[cons_id],
                kv_checksums={cons_id: bytes(len(first))},
            )
        )
        pulls = {cons_id: pull_meta}
        d_worker.process_pulling_result(
            d_worker._xfer_resp_decoder.decode(other), pulls
        )
    if order == "finished_later":
        consumer.step()
        consumer.step()
    d_worker.get_finished = lambda: (
        {prod_id},
        set(d_worker.finished_recving_reqs),
    )
    results = d_worker.get_transfer_results()
    d_worker.finished_recving_reqs.clear()
    p_worker.get_finished = lambda: ({prod_id}, set())
    p_worker.get_transfer_results()
    assert results.finished_recving == {cons_id}
    deliver_next(consumer, dict(results.kv_checksums or {}))
    consumer.finish_load(cons_id)
    consumer.run(cons_id)
    return verdicts.get(cons_id)


@pytest.fixture
def pd(model_dir: str, cuda_stream_stubs: Any) -> tuple:
    register_plugin()
    producer = mooncake_engine(model_dir, "prod", True)
    consumer = mooncake_engine(model_dir, "cons", False)
    workers = (
        bare_worker(producer.vllm_config, True),
        bare_worker(consumer.vllm_config, False),
    )
    return producer, consumer, workers


def test_mooncake_inside_multi_connector(
    model_dir: str, cuda_stream_stubs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R101 with R110-R114: a MultiConnector around MooncakeConnector on both
    sides verifies a clean load and catches a corrupted one."""
    from tests.v1.kv_connector.unit.test_kv_checksum_nixl_push import multi_around

    multi_around(monkeypatch, MOONCAKE)
    register_plugin()
    producer = mooncake_engine(model_dir, "prod", True)
    consumer = mooncake_engine(model_dir, "cons", False)
    assert type(producer.scheduler.connector).__name__ == "MultiConnector"
    workers = (
        bare_worker(producer.vllm_config, True),
        bare_worker(consumer.vllm_config, False),
    )
    verdict = run_pd(producer, consumer, workers, 0)
    assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED
    verdict = run_pd(producer, consumer, workers, 1, corrupt=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.MISMATCH
    assert package_state(producer) == 0 and package_state(consumer) == 0
    assert worker_state(*workers) == 0


def test_mooncake_carrier_and_declares() -> None:
    """R110, R115, R100: CONNECTOR for producer requests with a transfer id
    and for loads; the Mooncake store connector declares none. Catches a
    producer request without transfer_id counted as sending (Mooncake never
    sends it)."""
    register_plugin()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_checksum.config import (
        connector_declares_carrier,
    )

    carrier = mc_module().MooncakeConnector.kv_checksum_carrier
    conn = KVChecksumCarrier.CONNECTOR
    prod = make_request(
        "p", [1] * 20, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}
    )
    no_tid = make_request("q", [1] * 20, kv_transfer_params={"do_remote_decode": True})
    cons = make_request("d", [1] * 20, kv_transfer_params={"do_remote_prefill": True})
    assert carrier(None, prod, False) is conn
    assert carrier(None, no_tid, False) is None
    assert carrier(None, cons, True) is conn
    assert carrier(None, make_request("x", [1] * 20), False) is None

    def declares(name: str) -> bool:
        return connector_declares_carrier(
            KVTransferConfig(kv_connector=name, kv_role="kv_both")
        )

    assert declares(MOONCAKE)
    assert not declares("MooncakeStoreConnector")


@pytest.mark.parametrize("order", ["payload_with_kv", "finished_later"])
def test_mooncake_clean_loads_verified(pd: tuple, order: str) -> None:
    """R111-R114: clean loads are verified in both orders the worker can see
    (response and completion in one call, or the completion reported steps
    later); no per-request state is left in the schedulers or workers.
    Catches `take` dropping bytes kept before the load finished."""
    producer, consumer, workers = pd
    for i in range(3):
        verdict = run_pd(producer, consumer, workers, i, order=order)
        assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED
    assert package_state(producer) == 0 and package_state(consumer) == 0
    assert worker_state(*workers) == 0


def test_mooncake_corrupted_load_mismatch(pd: tuple) -> None:
    """R111-R114: a load corrupted after the transfer is a mismatch."""
    producer, consumer, workers = pd
    verdict = run_pd(producer, consumer, workers, 0, corrupt=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.MISMATCH
    assert package_state(consumer) == 0 and worker_state(*workers) == 0


def test_mooncake_duplicate_and_old_producer(pd: tuple) -> None:
    """R113, R114: two producer ranks answering (the first copy kept: the
    second, different, one ignored) verify; a
    producer without the package (no kv_checksums field) leaves the load
    unverified, never stuck."""
    producer, consumer, workers = pd
    verdict = run_pd(producer, consumer, workers, 0, duplicate=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED
    verdict = run_pd(producer, consumer, workers, 1, old_producer=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.UNVERIFIED
    assert consumer.final["c1"].finish_reason is not None
    assert package_state(consumer) == 0 and worker_state(*workers) == 0


def test_mooncake_aborted_producer_keeps_nothing(pd: tuple) -> None:
    """R111: an aborted producer request (not FINISHED_LENGTH_CAPPED) keeps
    no payload. Catches keep() ignoring whether the request will be sent."""
    producer, _, workers = pd
    request = make_request(
        "p", [1] * 20, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}
    )
    producer.add(request)
    producer.step()
    producer.scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    connector = mooncake_connector(producer)
    connector.send_kv_checksums(request, b"x" * 8)
    assert connector.connector_scheduler._kv_checksum_outbox.pending == {}
    meta = producer.step().kv_connector_metadata
    assert not getattr(meta, "kv_checksums", None)
    assert package_state(producer) == 0


def test_mooncake_worker_bad_responses(model_dir: str) -> None:
    """R113, R114: malformed or oversized kv_checksums, values for requests
    this pull does not load and failed loads leave nothing behind, and never
    fail the decode. Catches the byte cap missing (oversized bytes kept) and
    bytes kept for a request the pull does not load (never taken: a leak)."""
    register_plugin()
    mc = mc_module()
    engine = mooncake_engine(model_dir, "cons", False)
    worker = bare_worker(engine.vllm_config, False)
    received = worker._kv_checksum_received
    received.max_bytes = 16
    ext = response_class()
    finish = mc.MooncakeXferResponseStatus.FINISH
    for sums in ([1, 2], {"d1": 5}, {"d1": b"x" * 17}, {"other": b"y" * 8}):
        wire = msgspec.msgpack.encode(
            ext(status=finish, ok_reqs=["d1"], kv_checksums=sums)
        )
        response = worker._xfer_resp_decoder.decode(wire)
        received.keep(response, {"d1"})
    assert received.by_request == {}
    good = ext(status=finish, ok_reqs=["d1"], kv_checksums={"d1": b"z" * 8})
    received.keep(worker._xfer_resp_decoder.decode(msgspec.msgpack.encode(good)), {})
    assert received.by_request == {}  # not loading d1 (duplicate or late)
    wire = msgspec.msgpack.encode(
        ext(status=finish, ok_reqs=["d1"], kv_checksums={"d1": b"z" * 8})
    )
    received.keep(worker._xfer_resp_decoder.decode(wire), {"d1"})
    assert received.take(["d1"], ["d1"]) == {}
    assert received.by_request == {}


@pytest.mark.kv_checksum_capability("plugin")
def test_mooncake_send_kv_to_decode_context(model_dir: str) -> None:
    """R112 on vLLM's send_kv_to_decode: the pull's request blocks are
    visible to the encoder while the coroutine answers it, and not after.
    Catches a context leaking into other pulls' responses. The plugin's hook
    only: in the series send_kv_to_decode puts the checksums on the response
    itself."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring.mooncake import (
        CURRENT_PULL,
    )

    register_plugin()
    mc = mc_module()
    engine = mooncake_engine(model_dir, "prod", True)
    worker = bare_worker(engine.vllm_config, True)
    seen: list[Any] = []

    class Topo:
        def handshake_target_ranks(self, size: int) -> list[int]:
            seen.append(CURRENT_PULL.get())
            return []

    class Sock:
        async def send_multipart(self, parts: tuple) -> None:
            seen.append(parts[1])

    worker.transfer_topo = Topo()
    worker.tp_rank = 0
    meta = mc.MooncakeXferMetadata(
        remote_hostname="h",
        remote_port=1,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"d1": ("t1", [[1]])},
        kv_caches_base_addr=[],
        block_lens=[],
        kv_block_lens=[],
    )
    asyncio.run(worker.send_kv_to_decode(b"id", Sock(), meta))
    assert seen[0] == {"d1": ("t1", [[1]])}
    assert CURRENT_PULL.get() is None


def test_mooncake_store_says_uncovered(vllm_caplog: pytest.LogCaptureFixture) -> None:
    """R115: the Mooncake store connector carries no checksums and says so at
    start-up (checksums off with one warning; fail-closed refuses to start),
    while MooncakeConnector (P2P) enables them. Catches the P2P carrier
    installed on the store connector too (it would claim loads it cannot
    verify)."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_checksum.config import (
        ENABLE_KEY,
        kv_checksum_enabled,
    )

    register_plugin()

    def config(name: str, **extra: Any) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector=name,
                kv_role="kv_both",
                kv_connector_extra_config={ENABLE_KEY: True, **extra},
            )
        )

    assert kv_checksum_enabled(config(MOONCAKE)) is True
    assert kv_checksum_enabled(config("MooncakeStoreConnector")) is False
    assert any(
        "connector MooncakeStoreConnector declares no carrier" in r.getMessage()
        for r in vllm_caplog.records
    )
    with pytest.raises(ValueError, match="MooncakeStoreConnector declares no"):
        kv_checksum_enabled(
            config("MooncakeStoreConnector", kv_checksum_fail_closed=True)
        )


def test_mooncake_hostile_responses_bounded_r113_r114(model_dir: str) -> None:
    """R113, R114 and the rule that a producer's value never sizes the
    consumer's work: a response whose kv_checksums is huge (16 MiB of empty
    maps) or not UTF-8 still decodes, and keep() builds nothing from it
    (peak memory far below the value's own size); a pull with no local blocks
    (aborted before it was scheduled: vLLM never reports it finished) keeps
    no bytes.

    Bugs this fails: decoding the field as a Python object (over 1 GB for
    the maps, a failed decode for bad UTF-8, which fails the whole pull);
    checking the length after decoding; keeping bytes of a blockless pull
    (never taken: a leak per aborted request)."""
    register_plugin()
    mc = mc_module()
    engine = mooncake_engine(model_dir, "cons", False)
    worker = bare_worker(engine.vllm_config, False)
    received = worker._kv_checksum_received
    received.max_bytes = 64
    finish = mc.MooncakeXferResponseStatus.FINISH
    plain = msgspec.msgpack.encode(
        mc.MooncakeXferResponse(status=finish, ok_reqs=["d1"])
    )
    # Append one field to vLLM's map: a key and a hostile value.
    head, rest = plain[0], plain[1:]
    assert head & 0xF0 == 0x80  # a fixmap
    maps = b"\xdd" + (1 << 24).to_bytes(4, "big") + b"\x80" * (1 << 24)
    for value in (maps, b"\x81\xa2\xff\xfe\x01"):
        wire = bytes([head + 1]) + rest + msgspec.msgpack.encode("kv_checksums") + value
        tracemalloc.start()
        try:
            response = worker._xfer_resp_decoder.decode(wire)
            received.keep(response, {"d1"})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert response.ok_reqs == ["d1"]
        assert peak < 1 << 20, peak
        assert received.by_request == {}
    ext = response_class()
    good = msgspec.msgpack.encode(
        ext(status=finish, ok_reqs=["d1"], kv_checksums={"d1": b"z" * 8})
    )
    # Through vLLM's process_pulling_result: a pull with no local blocks.
    for blocks, kept in (([], {}), ([[4]], {"d1": b"z" * 8})):
        meta = mc.PullReqMeta("d1", "t1", blocks, "P", "addr", pull_tasks_count=1)
        worker.process_pulling_result(
            worker._xfer_resp_decoder.decode(good), {"d1": meta}
        )
        assert received.by_request == kept


# ----------------------------------------------------------------------
# The decode budget of a response (issue 32 item 6)
# ----------------------------------------------------------------------


def _response(ok_reqs: list[str], sums: dict[str, bytes]) -> bytes:
    mc = mc_module()
    ext = response_class()
    finish = mc.MooncakeXferResponseStatus.FINISH
    return msgspec.msgpack.encode(
        ext(status=finish, ok_reqs=ok_reqs, kv_checksums=sums)
    )


@pytest.mark.parametrize("repeats", [1, 1000])
def test_mooncake_budget_counts_each_loading_request_once(
    model_dir: str, vllm_caplog: pytest.LogCaptureFixture, repeats: int
) -> None:
    """R114, R129 (issue 32): the decode budget of a response is one
    request's bytes per distinct request this consumer loads. A map over the
    budget of its one loading request ("t", valid bytes plus 64 KiB of
    entries for other ids) is skipped with one warning and nothing kept (the
    load ends unverified), however often `ok_reqs` repeats "t" and whatever
    ids it adds that this consumer does not load. Catches the budget counted
    per `ok_reqs` entry: 1000 repeats (or 1000 foreign ids) multiplied it and
    the map was decoded and "t"'s bytes kept."""
    register_plugin()
    engine = mooncake_engine(model_dir, "cons", False)
    worker = bare_worker(engine.vllm_config, False)
    received = worker._kv_checksum_received
    received.max_bytes = 4096
    padding = {f"pad{i}": b"p" * 64 for i in range(1024)}  # ~70 KB of entries
    sums = {"t": b"z" * 8, **padding}
    foreign = [f"u{i}" for i in range(999)]
    for ok_reqs in (["t"] * repeats, ["t", *foreign]):
        response = worker._xfer_resp_decoder.decode(_response(ok_reqs, sums))
        vllm_caplog.clear()
        received.keep(response, {"t"})
        assert received.by_request == {}
        warnings = [
            r.getMessage()
            for r in vllm_caplog.records
            if r.levelno == logging.WARNING and "Mooncake response" in r.getMessage()
        ]
        assert len(warnings) == 1, warnings
        assert received.take(["t"], []) == {}
    # Within the budget of one request the same id's bytes are kept.
    small = worker._xfer_resp_decoder.decode(_response(["t"] * repeats, {"t": b"z"}))
    received.keep(small, {"t"})
    assert received.take(["t"], []) == {"t": b"z"}


def _largest_valid_payload(max_model_len: int, num_groups: int) -> bytes:
    """The largest payload a consumer with these sizes accepts, written with
    msgpack directly (SPEC 11, R129, R134): the TP cap 2^16, max_model_len
    tokens, per group the largest fingerprint and max_model_len + 1 values of
    one-token chunks from chunk 0; correctly hashed (R136)."""
    values = b"\xff" * 8 * (max_model_len + 1)
    groups = [[g, 2**64 - 1, 1, 0, values] for g in range(num_groups)]
    body = msgspec.msgpack.encode([1 << 16, max_model_len, groups])
    digest = hashlib.blake2b(body, digest_size=8).digest()
    return msgspec.msgpack.encode([2, int.from_bytes(digest, "little"), body])


def test_payload_cap_derived_from_the_consumer_sizes(model_dir: str) -> None:
    """R129, R134 (issue 32): without `kv_checksum_max_payload_bytes` the cap
    on one request's checksums is derived from the consumer's max_model_len
    and KV cache groups: the largest valid payload for those sizes (raw for
    Mooncake, base64 for kv_transfer_params) is accepted, a value one byte
    over the cap is refused, and the cap is that payload's base64 length plus
    at most 8 KiB, not a fixed 16 MiB. Catches a cap below a valid payload
    (fault-free loads unverified) or a fixed cap far above the consumer's
    own sizes (work sized by the peer)."""
    from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload

    register_plugin()
    engine = mooncake_engine(model_dir, "cons", False)
    config = make_kv_cache_config(engine.vllm_config)
    max_model_len = engine.vllm_config.model_config.max_model_len
    largest = _largest_valid_payload(max_model_len, len(config.kv_cache_groups))
    encoded = base64.b64encode(largest)
    # Scheduler side (kv_transfer_params, base64 text).
    limits = engine.checksums.limits
    assert len(encoded) <= limits.max_encoded_bytes <= len(encoded) + 8192
    payload = KVChecksumPayload.from_base64(encoded.decode(), limits)
    assert [len(g.values) for g in payload.groups] == [max_model_len + 1] * len(
        config.kv_cache_groups
    )
    with pytest.raises(ValueError, match="exceed the limit"):
        KVChecksumPayload.from_base64("A" * (limits.max_encoded_bytes + 1), limits)
    # Worker side (Mooncake, raw bytes per request), built with the worker's
    # KVCacheConfig.
    worker = bare_worker(engine.vllm_config, False, config)
    received = worker._kv_checksum_received
    assert received.max_bytes == limits.max_encoded_bytes
    decode = worker._xfer_resp_decoder.decode
    received.keep(decode(_response(["t"], {"t": largest})), {"t"})
    assert received.take(["t"], []) == {"t": largest}
    over = b"x" * (received.max_bytes + 1)
    received.keep(decode(_response(["t"], {"t": over})), {"t"})
    assert received.take(["t"], []) == {}


def _widest_payload_base64_len(max_model_len: int, num_groups: int) -> int:
    """Base64 length of a payload of `num_groups` groups of max_model_len + 1
    values with every integer at msgpack's widest (SPEC 11): envelope
    [version, hash, body] (fixarray 1, fixint 1, uint64 9, bin32 header 5),
    body [tp_size, num_tokens, groups] (1, 9, 9, array32 header 5), per group
    [group_id, fingerprint, chunk_tokens, start, values] (1, 4 x 9, bin32
    header 5, 8 bytes a value)."""
    group = 1 + 4 * 9 + 5 + 8 * (max_model_len + 1)
    raw = (1 + 1 + 9 + 5) + (1 + 9 + 9 + 5) + num_groups * group
    return 4 * ((raw + 2) // 3)


def test_payload_cap_counts_every_kv_cache_group(model_dir: str) -> None:
    """R129, R134 (issue 75): a consumer with two KV cache groups (full and
    sliding-window attention), more groups than tokens per chunk of a
    producer with 1-token blocks (R135): the derived cap is the base64
    length of the widest two-group payload plus the 4096 bytes of slack, on
    both carriers' sides; the largest valid payload (both groups full) is
    accepted, and one byte over the cap is skipped.

    Bug caught: the derived cap computed from one KV cache group instead of
    all of them (`wire/payload.py`): about half this payload, so Mooncake
    skips it (and kv_transfer_params refuses it) and every such load is
    unverified."""
    from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload

    register_plugin()
    engine = mooncake_engine(model_dir, "cons-groups", False, groups="both")
    config = make_kv_cache_config(engine.vllm_config)
    num_groups = len(config.kv_cache_groups)
    assert num_groups == 2
    max_model_len = engine.vllm_config.model_config.max_model_len
    largest = _largest_valid_payload(max_model_len, num_groups)
    widest = _widest_payload_base64_len(max_model_len, num_groups)
    assert len(base64.b64encode(largest)) <= widest
    cap = widest + 4096
    # Scheduler side (kv_transfer_params, base64 text).
    limits = engine.checksums.limits
    assert limits.max_encoded_bytes == cap
    payload = KVChecksumPayload.from_base64(base64.b64encode(largest).decode(), limits)
    assert [len(g.values) for g in payload.groups] == [max_model_len + 1] * 2
    with pytest.raises(ValueError, match="exceed the limit"):
        KVChecksumPayload.from_base64("A" * (cap + 1), limits)
    # Worker side (Mooncake, raw bytes per request).
    worker = bare_worker(engine.vllm_config, False, config)
    received = worker._kv_checksum_received
    assert received.max_bytes == cap
    decode = worker._xfer_resp_decoder.decode
    received.keep(decode(_response(["t"], {"t": largest})), {"t"})
    assert received.take(["t"], []) == {"t": largest}
    at_cap = b"x" * cap
    received.keep(decode(_response(["t"], {"t": at_cap})), {"t"})
    assert received.take(["t"], []) == {"t": at_cap}
    received.keep(decode(_response(["t"], {"t": at_cap + b"x"})), {"t"})
    assert received.take(["t"], []) == {}


def test_payload_cap_setting_overrides_the_derived_cap(model_dir: str) -> None:
    """R129: an explicit `kv_checksum_max_payload_bytes` is the cap on both
    carriers' sides. Catches the operator's setting ignored once the default
    is derived."""
    register_plugin()
    side = SideConfig(
        connector=MOONCAKE, connector_extra={"kv_checksum_max_payload_bytes": 5000}
    )
    engine = SimEngine(model_dir, side, "cons")
    assert engine.checksums.limits.max_encoded_bytes == 5000
    config = make_kv_cache_config(engine.vllm_config)
    worker = bare_worker(engine.vllm_config, False, config)
    assert worker._kv_checksum_received.max_bytes == 5000
