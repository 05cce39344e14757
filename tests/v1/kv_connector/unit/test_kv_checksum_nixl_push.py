# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push as a CONNECTOR carrier (R103-R109), on CPU.

Producer and consumer are real vLLM Schedulers with NixlPushConnector's
scheduler side and simulated checksum workers (`kv_checksum_pd.SimEngine`).
The NIXL worker side is vLLM's NixlPushConnectorWorker built without NIXL
(`bare_push_worker`): its methods run for real down to the WRITE (only the
descriptor arithmetic is stubbed), the agent is a fake recording the WRITEs'
notifs. On vLLM 0.33.0 the plugin's hooks carry the checksums; on a vLLM
with the in-tree series (its NIXL push commit) vLLM's own code does, and the
same tests run against it (`attach_checksums` and `turn_off_checksums` are
the only calls that differ).
"""

import queue
import threading
import tracemalloc
from collections import defaultdict
from typing import Any

import msgspec
import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
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
from vllm.distributed.kv_transfer.kv_checksum.carriers import nixl_push
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import KVChecksumStatus
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.kv_checksum_capability("nixl_push")

PUSH = "NixlPushConnector"
PUSH_REG = b"PUSH_REG:"
MAX_BYTES = 1 << 20


def child_meta(meta: Any) -> Any:
    """The NIXL metadata, inside a MultiConnector's if there is one."""
    return getattr(meta, "metadata", (meta,))[0]


def push_connector(engine: SimEngine) -> Any:
    connector = engine.scheduler.connector
    return getattr(connector, "_connectors", [connector])[0]


def push_engine(model_dir: str, name: str, **kw: Any) -> SimEngine:
    return SimEngine(model_dir, SideConfig(connector=PUSH, **kw), name)


def produce_push(producer: SimEngine, req_id: str, prompt: list[int]) -> tuple:
    """Run a producer request to its end and one more step; return its
    params and the connector metadata that shipped its finished blocks."""
    producer.add(
        make_request(
            req_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
    )
    final = producer.run(req_id)
    out = producer.step()
    return dict(final.kv_transfer_params), child_meta(out.kv_connector_metadata)


def start_load(consumer: SimEngine, req_id: str, prompt: list, params: dict) -> Any:
    consumer.add(make_request(req_id, prompt, max_tokens=2, kv_transfer_params=params))
    out = consumer.step()
    request = consumer.scheduler.requests[req_id]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return child_meta(out.kv_connector_metadata)


def write_kv(
    producer: SimEngine, consumer: SimEngine, req_id: str, params: dict
) -> list[list[int]]:
    """The WRITE: producer blocks into the consumer's, by position."""
    end = consumer.scheduler.requests[req_id].num_computed_tokens
    return transfer(
        producer,
        per_group(params["remote_block_ids"]),
        consumer,
        consumer.block_ids(req_id),
        list(range(0, end)),
    )


def notif(meta_p: Any, reg: dict, prod_id: str, cons_id: str, tp: int = 1) -> bytes:
    """What the producer worker's WRITE carries (R105) for this registration."""
    store = nixl_push.PushSendStore()
    store.add(getattr(meta_p, "push_finished_kv_checksums", None))
    plain = f"{cons_id}:{tp}".encode()
    if not nixl_push.wants_checksum_notif(reg):
        return plain
    nixl_push.PUSH_WRITE.data = store.get(prod_id)
    try:
        return nixl_push.PUSH_WRITE.notif_for(plain)
    finally:
        nixl_push.PUSH_WRITE.data = None


def package_state(engine: SimEngine) -> int:
    """Entries in the package's per-request dictionaries of one engine."""
    return harness_state(engine, push_connector(engine).connector_scheduler)


def run_pd(
    producer: SimEngine,
    consumer: SimEngine,
    idx: int,
    *,
    corrupt: bool = False,
    payload: str = "with",  # "with", "lost", "duplicate", "garbage", "oversize"
) -> Any:
    """One P/D load over NIXL push; returns the consumer's verdict."""
    prompt = [(idx * 7 + i) % 50 + 1 for i in range(37)]
    prod_id, cons_id = f"p{idx}", f"c{idx}"
    params, meta_p = produce_push(producer, prod_id, prompt)
    verdicts = capture_verdicts(consumer)
    meta_c = start_load(consumer, cons_id, prompt, params)
    reg = meta_c.push_registrations[cons_id]
    nixl_push.advertise(meta_c.push_registrations)
    copied = write_kv(producer, consumer, cons_id, params)
    if corrupt:
        blocks = consumer.block_ids(cons_id)[0]
        apply_fault(consumer, blocks, copied[0], Fault("bit_flip", position=1))
    q = nixl_push.ChecksumNotifQueue.attach(queue.Queue(), MAX_BYTES)
    message = notif(meta_p, reg, prod_id, cons_id)
    if payload == "lost":
        message = f"{cons_id}:1".encode()
    elif payload == "garbage":
        message = nixl_push.KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(
            [cons_id, 1, b"\x01" * 12]
        )
    elif payload == "oversize":
        q.kv_checksum_max_bytes = 8
    q.put(message)
    if payload == "duplicate":
        q.put(notif(meta_p, reg, prod_id, cons_id))
    plain = [q.get_nowait() for _ in range(q.qsize())]
    assert all(p == f"{cons_id}:1".encode() for p in plain)
    received = q.take([cons_id], [])
    assert q.kv_checksum_received == {}
    deliver_next(consumer, received)
    consumer.finish_load(cons_id)
    consumer.run(cons_id)
    return verdicts.get(cons_id)


@pytest.fixture
def pd(model_dir: str, cuda_stream_stubs: Any) -> tuple[SimEngine, SimEngine]:
    register_plugin()
    return push_engine(model_dir, "prod"), push_engine(model_dir, "cons")


def multi_around(monkeypatch: pytest.MonkeyPatch, child: str) -> None:
    """SimEngines built from now on run a MultiConnector around `child`."""
    from tests.v1.kv_connector.unit import kv_checksum_pd

    original = kv_checksum_pd.make_vllm_config

    def make_vllm_config(*args: Any, **kw: Any) -> Any:
        if kw.get("kv_connector") == child:
            kw["kv_connector"] = "MultiConnector"
            kw["extra_config"] = {
                **kw["extra_config"],
                "connectors": [{"kv_connector": child, "kv_role": "kv_both"}],
            }
        return original(*args, **kw)

    monkeypatch.setattr(kv_checksum_pd, "make_vllm_config", make_vllm_config)


def test_push_inside_multi_connector(
    model_dir: str, cuda_stream_stubs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R101 with R103-R107: a MultiConnector around NixlPushConnector on both
    sides verifies a clean load and catches a corrupted one: its producer
    request's payload goes to the push child (send_kv_checksums) and the
    load's carrier is the child's."""
    multi_around(monkeypatch, PUSH)
    register_plugin()
    producer, consumer = push_engine(model_dir, "prod"), push_engine(model_dir, "cons")
    assert type(producer.scheduler.connector).__name__ == "MultiConnector"
    verdict = run_pd(producer, consumer, 0)
    assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED
    verdict = run_pd(producer, consumer, 1, corrupt=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.MISMATCH
    assert package_state(producer) == 0 and package_state(consumer) == 0


def test_push_carrier_and_declares() -> None:
    """R103, R100: CONNECTOR for producer requests and loads, None for a
    bidirectional load; NixlPushConnector now declares a carrier. Catches the
    carrier answering KV_TRANSFER_PARAMS (the consumer would wait for a key
    push never sends) or nothing."""
    register_plugin()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_checksum.config import (
        connector_declares_carrier,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPushConnector,
    )

    carrier = NixlPushConnector.kv_checksum_carrier
    conn = KVChecksumCarrier.CONNECTOR
    prod = make_request("p", [1] * 20, kv_transfer_params={"do_remote_decode": True})
    cons = make_request("d", [1] * 20, kv_transfer_params={"do_remote_prefill": True})
    both = make_request(
        "b",
        [1] * 20,
        kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": True},
    )
    assert carrier(None, prod, False) is conn
    assert carrier(None, cons, True) is conn
    assert carrier(None, both, True) is None
    assert carrier(None, make_request("x", [1] * 20), False) is None
    assert connector_declares_carrier(
        KVTransferConfig(kv_connector=PUSH, kv_role="kv_both")
    )
    child = {"kv_connector": PUSH, "kv_role": "kv_both"}
    assert connector_declares_carrier(
        KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
    )


def test_push_clean_loads_verified(pd: tuple[SimEngine, SimEngine]) -> None:
    """R104-R107: clean loads over push are verified, and no per-request
    state is left on either side. Catches the outbox dropping the payload of
    a request it should ship (keep() guard inverted: every load unverified)."""
    producer, consumer = pd
    for i in range(3):
        verdict = run_pd(producer, consumer, i)
        assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED
    assert package_state(producer) == 0 and package_state(consumer) == 0


def test_push_corrupted_load_mismatch(pd: tuple[SimEngine, SimEngine]) -> None:
    """R104-R107: a load corrupted after the WRITE is a mismatch."""
    producer, consumer = pd
    verdict = run_pd(producer, consumer, 0, corrupt=True)
    assert verdict is not None and verdict.status == KVChecksumStatus.MISMATCH
    assert package_state(producer) == 0 and package_state(consumer) == 0


@pytest.mark.parametrize("payload", ["lost", "garbage", "oversize"])
def test_push_missing_payload_unverified(
    pd: tuple[SimEngine, SimEngine], payload: str
) -> None:
    """R99, R107: a plain notif (producer without checksums), an invalid
    payload or one above the consumer's byte cap: the load completes (never
    stuck) and is unverified. Catches the oversize cap missing (a payload of
    any size accepted) through the oversize case."""
    producer, consumer = pd
    verdict = run_pd(producer, consumer, 0, payload=payload)
    assert verdict is not None and verdict.status == KVChecksumStatus.UNVERIFIED
    assert consumer.final["c0"].finish_reason is not None
    assert package_state(producer) == 0 and package_state(consumer) == 0


def test_push_duplicate_notifs_first_copy(pd: tuple[SimEngine, SimEngine]) -> None:
    """R106: every producer rank writing to a consumer rank sends the same
    bytes; duplicates are translated, the first copy kept, verified."""
    producer, consumer = pd
    verdict = run_pd(producer, consumer, 0, payload="duplicate")
    assert verdict is not None and verdict.status == KVChecksumStatus.VERIFIED


def test_push_aborted_producer_keeps_nothing(pd: tuple[SimEngine, SimEngine]) -> None:
    """R104: send_kv_checksums keeps bytes only for a request whose blocks are
    about to be pushed; an aborted producer leaves nothing. Catches keep()
    ignoring `about_to_push` (a payload kept forever)."""
    producer, _ = pd
    conn = push_connector(producer)
    request = make_request("p", [1] * 20, kv_transfer_params={"do_remote_decode": True})
    conn.send_kv_checksums(request, b"x" * 8)
    outbox = conn.connector_scheduler._kv_checksum_outbox
    assert outbox.pending == {}
    producer.add(request)
    producer.step()
    producer.scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        producer.step()
    assert package_state(producer) == 0


def test_push_consumer_abort_and_timeout_no_state(
    pd: tuple[SimEngine, SimEngine],
) -> None:
    """R74, R107: a consumer load aborted while waiting for the push, and one
    whose checksum notif arrives after the load was dropped, leave no state
    in the checksum scheduler or the notif queue."""
    producer, consumer = pd
    prompt = [3] * 37
    params, meta_p = produce_push(producer, "p0", prompt)
    meta_c = start_load(consumer, "c0", prompt, params)
    consumer.scheduler.finish_requests("c0", RequestStatus.FINISHED_ABORTED)
    consumer.step()
    q = nixl_push.ChecksumNotifQueue.attach(queue.Queue(), MAX_BYTES)
    nixl_push.advertise(meta_c.push_registrations)
    q.put(notif(meta_p, meta_c.push_registrations["c0"], "p0", "c0"))
    assert "c0" in q.kv_checksum_received
    assert q.take([], []) == {}  # no longer loading: dropped
    assert q.kv_checksum_received == {}
    assert package_state(consumer) == 0 and package_state(producer) == 0


# ---------------------------------------------------------------------------
# vLLM's NixlPushConnectorWorker with the hooks (no NIXL library needed)
# ---------------------------------------------------------------------------


class FakeAgent:
    """Records the notif of every WRITE prepared (the NIXL agent's role)."""

    def __init__(self) -> None:
        self.notifs: list[bytes] = []

    def make_prepped_xfer(self, *args: Any, notif_msg: bytes = b"") -> int:
        self.notifs.append(notif_msg)
        return len(self.notifs)

    def transfer(self, handle: int) -> str:
        return "PROC"


def attach_checksums(worker: Any, engine: SimEngine) -> None:
    """Checksums on for a bare push worker, as at start-up with them on: the
    plugin's registration on vLLM 0.33.0, the worker's own set-up in the
    series."""
    if native_kv_checksums():
        worker._init_kv_checksums(engine.vllm_config, engine.scheduler.kv_cache_config)
    else:
        from vllm.distributed.kv_transfer.kv_checksum.wiring import nixl_push as wiring

        wiring._attach_nixl_push_worker(worker, engine.vllm_config)


def turn_off_checksums(worker: Any) -> None:
    """What an error in the push worker's checksum code does."""
    if native_kv_checksums():
        worker._turn_off_kv_checksums(worker, "_kv_checksum_push", "test")
    else:
        from vllm.distributed.kv_transfer.kv_checksum.wiring import nixl_push as wiring

        wiring._disable_push_worker(worker, "_kv_checksum_push", "test")


def _real_write_path(worker: Any, engine_id: str = "D") -> None:
    """What vLLM's `_xfer_blocks_for_req` and `_xfer_blocks` read on their way
    to the agent: one consumer rank, same TP and block size, one region."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (
        TPMapping,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    remote = SimpleNamespace(
        remote_tp_size=1, remote_block_size=16, remote_physical_blocks_per_logical=1
    )
    worker.transfer_topo = SimpleNamespace(
        get_engine_info=lambda engine: remote,
        tp_ratio=lambda tp_size: 1,
        block_size_ratio=lambda block_size: 1,
    )
    worker.tp_mappings = {
        engine_id: TPMapping(
            source_ranks_per_group=((0,),),
            all_source_ranks=(0,),
            rank_to_attention_slot={0: 0},
            rank_offset_factor=0,
        )
    }
    worker.engine_id = "P"
    worker.region_group_ids = [0]
    worker._uses_region_group_mapping = False
    worker._transfer_layer_group_ids = ()
    worker.use_mla = worker._has_mamba = worker._is_csa_linear = False
    worker._group_spec_types = (FullAttentionSpec,)
    worker.dst_xfer_side_handles = {engine_id: {0: 1}}
    worker.src_xfer_handles_by_block_size = {16: 2}
    for name in ("dst_num_blocks", "dst_region_num_blocks"):
        setattr(worker, name, {engine_id: 100, "P": 100})
    worker.dst_region_group_ids = {engine_id: [0], "P": [0]}
    worker.dst_uses_region_group_mapping = {engine_id: False, "P": False}
    worker._sending_transfers_lock = threading.Lock()
    worker._sending_transfers = defaultdict(list)
    # Descriptor arithmetic only: block ids stand for descriptor ids.
    worker._apply_prefix_caching = lambda **kw: (
        kw["decode_block_ids"],
        kw["prefill_block_ids"],
    )
    worker._compute_desc_ids = lambda block_ids, **kw: [b for g in block_ids for b in g]


def bare_push_worker(vllm_config: Any, world_size: int = 1) -> Any:
    """vLLM's NixlPushConnectorWorker without NIXL: just the attributes the
    hooked methods and vLLM's own notif accounting read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    worker = NixlPushConnectorWorker.__new__(NixlPushConnectorWorker)
    worker.nixl_wrapper = FakeAgent()
    worker._pending_completion_notifs = queue.Queue()
    worker._recving_metadata = {}
    worker.consumer_notification_counts_by_req = defaultdict(int)
    worker._recving_transfers = {}
    worker.world_size = world_size
    worker.vllm_config = vllm_config
    worker._engine_last_active = {}
    worker._physical_blocks_per_logical_kv_block = 1
    worker._ensure_handshake = lambda *a, **k: None
    worker.xfer_stats = type(
        "Stats", (), {"record_notification_after_expiry": (lambda self: None)}
    )()
    worker._logical_to_kernel_block_ids = lambda ids, n: ids
    _real_write_path(worker)
    return worker


def test_push_worker_hooks_producer(model_dir: str) -> None:
    """R105, R106 on vLLM's NixlPushConnectorWorker: start_load_kv hands the
    payload to the writer, `_do_start_push_kv` WRITEs the checksum notif only
    to a consumer that advertised it, eviction drops the payload; with
    checksums off the WRITE's notif is vLLM's plain form and nothing is
    attached. Catches sending checksum notifs to a consumer that did not ask
    (wants_checksum_notif ignored: an off consumer would fail to decode)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    register_plugin()
    engine = push_engine(model_dir, "prod")
    off = bare_push_worker(engine.vllm_config)
    reg = {"request_id": "d1", "decode_engine_id": "D", "local_block_ids": [[1]]}
    reg.update(decode_host="h", decode_port=1, decode_tp_size=1)
    off._do_start_push_kv("p1", [[7]], dict(reg))
    assert off.nixl_wrapper.notifs == [b"d1:1"]
    assert "_kv_checksum_push" not in off.__dict__

    worker = bare_push_worker(engine.vllm_config)
    worker._reg_send_inbox = queue.Queue()
    worker._finished_blocks_inbox = queue.Queue()
    worker._push_writer_wake = threading.Event()
    worker.pcp_rank = 0
    worker._reqs_to_process, worker._reqs_to_send = set(), {}
    worker._send_heartbeats = lambda meta: None
    attach_checksums(worker, engine)
    meta = NixlConnectorMetadata()
    meta.push_finished_blocks = {"p1": [[7]]}
    meta.push_finished_kv_checksums = {"p1": b"\x00" * 16}
    worker.start_load_kv(meta)
    assert worker._finished_blocks_inbox.get_nowait() == ("p1", [[7]])
    worker._do_start_push_kv("p1", [[7]], dict(reg))  # not advertised
    advertised = dict(reg)
    nixl_push.advertise({"d1": advertised})
    worker._do_start_push_kv("p1", [[7]], advertised)
    plain, with_sums = worker.nixl_wrapper.notifs
    assert plain == b"d1:1"
    assert with_sums == nixl_push.encode_checksum_notif("d1", 1, b"\x00" * 16)
    worker._kv_checksum_push.evict(["p1"])
    assert worker._kv_checksum_push.by_request == {}


def test_push_worker_hooks_consumer(model_dir: str) -> None:
    """R107 on vLLM's own completion accounting: checksum notifs count as
    completions (producer TP 2 -> consumer TP 1: two notifs, first copy
    kept), an undecodable one is dropped like a lost notif, the bytes of a
    request no longer loading are dropped. Catches the queue passing the
    checksum form through (vLLM's UTF-8 decode would raise)."""
    register_plugin()
    engine = push_engine(model_dir, "cons")
    worker = bare_push_worker(engine.vllm_config)
    attach_checksums(worker, engine)

    class Meta:
        pp_size = 1

    worker._recving_metadata = {"d1": Meta(), "d2": Meta()}
    q = worker._pending_completion_notifs
    q.put(nixl_push.encode_checksum_notif("d1", 2, b"A" * 8))
    q.put(nixl_push.KV_CHECKSUM_NOTIF_PREFIX + b"\xc1garbage")
    q.put(nixl_push.encode_checksum_notif("d1", 2, b"B" * 8))
    q.put(nixl_push.encode_checksum_notif("gone", 1, b"C" * 8))
    worker._get_new_notifs()
    assert set(worker._recving_transfers) == {"d1"}
    taken = q.take(["d1"], ["d2"])
    assert taken == {"d1": b"A" * 8}
    assert q.kv_checksum_received == {}


def test_push_worker_get_transfer_results(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R99, R107 through vLLM's NixlPushConnectorWorker.get_transfer_results
    (its base part replaced by the notif accounting it starts with): a load
    completed by checksum notifs reports its first copy with its
    finished_recving; one still waiting for a second notif (producer TP 2)
    keeps its bytes to a later call; a finished send drops its payload.
    Catches reporting bytes before the load finished (`take` given every
    received id) and a payload store that is never evicted."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    register_plugin()
    engine = push_engine(model_dir, "both")
    worker = bare_push_worker(engine.vllm_config)
    worker._push_writer_wake = threading.Event()
    worker._sending_transfers_lock = threading.Lock()
    worker._sending_transfers = defaultdict(list)
    worker._send_failures = set()
    worker._reqs_to_send, worker._reqs_to_process = {}, set()
    worker._evict_finished_inbox = queue.Queue()
    attach_checksums(worker, engine)

    def base_results(self: Any) -> KVConnectorTransferResults:
        self._get_new_notifs()
        done = set(self._recving_transfers)
        for req_id in done:
            del self._recving_transfers[req_id], self._recving_metadata[req_id]
        sent = {"p1"} if "p1" in self._kv_checksum_push.by_request else set()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done)

    monkeypatch.setattr(NixlBaseConnectorWorker, "get_transfer_results", base_results)

    class Meta:
        pp_size = 1

    worker._recving_metadata = {"d1": Meta(), "d2": Meta()}
    worker._kv_checksum_push.add({"p1": b"P" * 8})
    q = worker._pending_completion_notifs
    q.put(nixl_push.encode_checksum_notif("d1", 1, b"A" * 8))
    q.put(nixl_push.encode_checksum_notif("d2", 2, b"B" * 8))
    first = worker.get_transfer_results()
    assert first.finished_recving == {"d1"}
    assert first.kv_checksums == {"d1": b"A" * 8}
    assert worker._kv_checksum_push.by_request == {}
    q.put(nixl_push.encode_checksum_notif("d2", 2, b"C" * 8))
    second = worker.get_transfer_results()
    assert second.finished_recving == {"d2"}
    assert second.kv_checksums == {"d2": b"B" * 8}
    assert q.kv_checksum_received == {}


@pytest.mark.parametrize("order", ["blocks_first", "registration_first"])
def test_push_arrival_orders_producer(model_dir: str, order: str) -> None:
    """R105 in both orders the producer worker can meet a request in: its
    finished blocks (with checksums) before the consumer's registration
    (vLLM's `_handle_push_reg_notif` starts the push) or the registration
    first (the writer matches it when the blocks arrive). Both WRITEs carry
    the checksums."""
    register_plugin()
    engine = push_engine(model_dir, "prod")
    worker = bare_push_worker(engine.vllm_config)
    worker._push_finished_blocks, worker._pending_d_registrations = {}, {}
    attach_checksums(worker, engine)
    reg = {"request_id": "d1", "decode_engine_id": "D", "local_block_ids": [[1]]}
    reg.update(decode_host="h", decode_port=1, decode_tp_size=1)
    nixl_push.advertise({"d1": reg})
    worker._kv_checksum_push.add({"d1": b"S" * 8})
    if order == "blocks_first":
        worker._push_finished_blocks["d1"] = [[7]]
        notif_msg = PUSH_REG + msgspec.msgpack.encode(reg)
        worker._handle_push_reg_notif(notif_msg)
    else:
        worker._pending_d_registrations["d1"] = reg
        matched = worker._pop_matching_registration("d1")
        worker._do_start_push_kv("d1", [[7]], matched)
    assert worker.nixl_wrapper.notifs == [
        nixl_push.encode_checksum_notif("d1", 1, b"S" * 8)
    ]


def test_push_hostile_notifs_bounded_and_complete_r107(model_dir: str) -> None:
    """R107 and the rule that a producer's value never sizes the consumer's
    work: a checksum notif whose checksums element is 2 MiB of empty maps,
    is not bytes, or is longer than the consumer's limit still completes its
    load (the plain "id:tp" form is queued, nothing kept: unverified), with
    peak memory far below the element's own size; only a notif whose id and
    TP size do not decode is dropped. After checksums are turned off on the
    worker, checksum notifs still complete their loads and keep no bytes.

    Bugs this fails: decoding the notif untyped (about 150 MB for the maps);
    dropping the whole notif for an oversized payload (the load never
    completes); keeping bytes after the worker's checksums were disabled
    (never taken: a leak)."""
    register_plugin()
    engine = push_engine(model_dir, "cons")
    worker = bare_push_worker(engine.vllm_config)
    attach_checksums(worker, engine)
    q = worker._pending_completion_notifs
    q.kv_checksum_max_bytes = 64
    prefix = nixl_push.KV_CHECKSUM_NOTIF_PREFIX
    maps = b"\xdd" + (1 << 21).to_bytes(4, "big") + b"\x80" * (1 << 21)
    for element in (
        maps,
        msgspec.msgpack.encode([1, 2]),
        msgspec.msgpack.encode(b"x" * 5000),
    ):
        notif = prefix + b"\x93" + msgspec.msgpack.encode("d1") + b"\x02" + element
        tracemalloc.start()
        try:
            q.put(notif)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
        assert q.get_nowait() == b"d1:2"
        assert q.kv_checksum_received == {}
    q.put(prefix + msgspec.msgpack.encode([1, 2, b""]))  # no id: dropped
    assert q.qsize() == 0
    q.put(nixl_push.encode_checksum_notif("d1", 1, b"s" * 8))
    assert q.kv_checksum_received == {"d1": b"s" * 8}
    assert q.get_nowait() == b"d1:1"
    turn_off_checksums(worker)  # as after an error
    assert q.kv_checksum_received == {}
    q.put(nixl_push.encode_checksum_notif("d2", 1, b"s" * 8))
    assert q.get_nowait() == b"d2:1"
    assert q.kv_checksum_received == {}


def test_push_checksum_notif_wire_format_r105() -> None:
    """R105 against fixed bytes (not the package's own encoder): the prefix,
    then msgpack [consumer request id, producer TP size, checksums as bin].
    Bug this fails: another element order or a str instead of bin (a peer
    of another release could not decode it)."""
    notif = nixl_push.encode_checksum_notif("d1", 2, b"\x01\x02")
    assert (
        notif == b"KV_CHECKSUM:" + b"\x93" + b"\xa2d1" + b"\x02" + b"\xc4\x02\x01\x02"
    )
    assert nixl_push.decode_checksum_notif(notif, 16) == ("d1", 2, b"\x01\x02")
