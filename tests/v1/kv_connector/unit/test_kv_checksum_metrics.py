# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checksum verdict metrics through vLLM's own stats path (R130).

A simulated P/D pair (real vLLM schedulers with the plugin's hooks,
`kv_checksum_pd`) runs verified, mismatching and unverified loads with
`log_stats` on; the `SchedulerStats` its steps return are fed to vLLM 0.33.0's
real `PrometheusStatLogger` / `LoggingStatLogger` exactly as the API server
does, and the counters are read back from `prometheus_client.REGISTRY`.
Every test starts and ends with vLLM's collectors unregistered.

On a vLLM with the in-tree series the same tests run against vLLM's own
calls: the counts travel in `SchedulerStats.kv_checksum_stats` instead of
under `STATS_KEY` in `kv_connector_stats` (`checksum_data` reads either);
the tests of the plugin's key stripping are plugin-only.
"""

import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    native_capability,
    native_kv_checksums,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    Fault,
    SideConfig,
    SimEngine,
    consume,
    produce,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import (
    STATS_KEY,
    KVChecksumStats,
    TrackedRecount,
    split_stats,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prom_metrics import (
    OTHER_REASON,
    REASON_LABELS,
    VERDICT_LABELS,
    reason_label,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import UnverifiedReason
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]


def prompt(i: int) -> list[int]:
    """40 tokens (39 loaded, block positions 0-2), distinct per i: no prefix hits."""
    return list(range(100 + 40 * i, 140 + 40 * i))


NO_CHECKSUMS = reason_label(UnverifiedReason.NO_CHECKSUMS.value)


@pytest.fixture(autouse=True)
def clean_vllm_metrics():
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


@pytest.fixture
def pd_pair(model_dir: str) -> tuple[SimEngine, SimEngine]:
    producer = SimEngine(model_dir, SideConfig(log_stats=True), "producer")
    consumer = SimEngine(model_dir, SideConfig(log_stats=True), "consumer")
    return producer, consumer


def run_three_loads(producer: SimEngine, consumer: SimEngine) -> None:
    """One verified, one mismatching (one position), one unverified load."""
    ok = produce(producer, "p-ok", prompt(0))
    bad = produce(producer, "p-bad", prompt(1))
    none = produce(producer, "p-none", prompt(2))
    del none[KV_TRANSFER_PARAMS_KEY]
    consume(consumer, producer, "c-ok", prompt(0), ok)
    consume(consumer, producer, "c-bad", prompt(1), bad, fault=Fault("bit_flip"))
    consume(consumer, producer, "c-none", prompt(2), none)


def checksum_data(stats: Any) -> Any:
    """The checksum counts one SchedulerStats carries (None: none): its
    `kv_checksum_stats` field on a vLLM with the series, the plugin's
    `STATS_KEY` entry of `kv_connector_stats` on vLLM 0.33.0."""
    if native_kv_checksums():
        assert STATS_KEY not in (stats.kv_connector_stats or {})
        return stats.kv_checksum_stats
    return (stats.kv_connector_stats or {}).get(STATS_KEY)


def checksum_counts(engine: SimEngine) -> KVChecksumStats:
    """The sum of the checksum counts in every SchedulerStats the engine returned."""
    total = KVChecksumStats()
    for stats in engine.scheduler_stats:
        data = checksum_data(stats)
        if data is not None:
            part = KVChecksumStats.from_dict(data)
            total.loads.update(part.loads)
            total.unverified_reasons.update(part.unverified_reasons)
            total.mismatched_positions += part.mismatched_positions
            total.sent += part.sent
            total.not_sent.update(part.not_sent)
            total.quarantined_blocks += part.quarantined_blocks
    return total


def sample(name: str, logger: PrometheusStatLogger, engine: int = 0, **labels: str):
    model_name, engine_label = logger.per_engine_labelvalues[engine]
    return REGISTRY.get_sample_value(
        name, {"model_name": str(model_name), "engine": str(engine_label), **labels}
    )


def record_all(logger: Any, engine: SimEngine, engine_idx: int = 0) -> None:
    """Feed every SchedulerStats to a stat logger as vLLM's output handler does."""
    for stats in engine.scheduler_stats:
        logger.record(
            scheduler_stats=stats, iteration_stats=None, engine_idx=engine_idx
        )


# --------------------------------------------------------------------------
# Counts and labels
# --------------------------------------------------------------------------


def test_stats_dict_round_trip():
    """R130: the counts survive to_dict/from_dict (they cross processes as a
    plain dict); malformed entries read as zero instead of raising in the API
    server; take() hands over and resets. Catches a lossy or crashing codec."""
    stats = KVChecksumStats()
    stats.loads.update({"verified": 2, "mismatch": 1})
    stats.unverified_reasons["the producer sent no checksums"] = 3
    stats.mismatched_positions = 4
    stats.sent = 5
    stats.not_sent["not every worker reported its checksums"] = 6
    stats.quarantined_blocks = 7
    stats.disabled_workers = 8
    data = stats.to_dict()
    assert KVChecksumStats.from_dict(data) == stats
    assert all(type(v) in (dict, int) for v in data.values())
    assert KVChecksumStats.from_dict(None) == KVChecksumStats()
    bad = {"loads": [1], "sent": "x", "mismatched_positions": True, "not_sent": {1: -2}}
    assert KVChecksumStats.from_dict(bad) == KVChecksumStats()
    taken = stats.take()
    assert taken.to_dict() == data and stats.is_empty()


def test_reason_labels_cover_every_fixed_reason():
    """R130: every fixed reason of section 12 has its own stable snake_case
    label; an unknown text maps to "other". Catches a reason added without a
    label (it would silently count as "other")."""
    labels = [REASON_LABELS[reason.value] for reason in UnverifiedReason]
    assert len(set(labels)) == len(labels) == len(REASON_LABELS)
    assert all(label.isidentifier() and label.islower() for label in labels)
    assert OTHER_REASON not in labels
    assert reason_label("something new") == OTHER_REASON
    assert set(VERDICT_LABELS) == {"verified", "mismatch", "unverified"}


def test_split_stats_never_mutates():
    """R130: the checksum key is split off without touching the shared dict
    (every stat logger reads the same SchedulerStats). Catches a pop() that
    would hide the counts from the logger running second."""
    data = {STATS_KEY: {"sent": 1}, "Nixl": {"x": 1}}
    ours, rest = split_stats(data)
    assert ours == {"sent": 1} and rest == {"Nixl": {"x": 1}}
    assert STATS_KEY in data
    assert split_stats({"Nixl": {}}) == (None, None)


# --------------------------------------------------------------------------
# Scheduler side: make_stats
# --------------------------------------------------------------------------


def test_make_stats_carries_counts_once(pd_pair):
    """R130: with log_stats, each step's SchedulerStats carries the counts
    taken since the previous one (in kv_checksum_stats; with the plugin,
    under "kv_checksum" in kv_connector_stats); the total over all steps is
    exact (nothing counted twice or lost) and a later make_stats() without
    new verdicts carries none. Catches counts that never leave the scheduler
    or are re-sent every step."""
    producer, consumer = pd_pair
    run_three_loads(producer, consumer)
    loads = checksum_counts(consumer)
    assert dict(loads.loads) == {"verified": 1, "mismatch": 1, "unverified": 1}
    assert dict(loads.unverified_reasons) == {UnverifiedReason.NO_CHECKSUMS.value: 1}
    assert loads.mismatched_positions == 1
    if native_capability("containment"):
        assert loads.quarantined_blocks == 3  # R138: loaded positions 0-2
    assert checksum_counts(producer).sent == 3
    for engine in pd_pair:
        later = engine.scheduler.make_stats()
        assert later is not None
        assert checksum_data(later) is None


def test_make_stats_without_log_stats_keeps_counts(model_dir):
    """R130: without log_stats vLLM's make_stats returns None and the hook
    takes nothing (no SchedulerStats to carry them). Catches a hook that
    drains the counts into nowhere or fails on None."""
    producer = SimEngine(model_dir, SideConfig(), "producer")
    produce(producer, "p-0", prompt(0))
    assert producer.scheduler.make_stats() is None
    assert producer.checksums.stats.sent == 1
    assert producer.scheduler_stats == []


# --------------------------------------------------------------------------
# API server side: PrometheusStatLogger and LoggingStatLogger
# --------------------------------------------------------------------------


def test_prometheus_counts_consumer_verdicts(pd_pair):
    """R130: vLLM's PrometheusStatLogger exposes the consumer's verdicts on
    its registry: loads by verdict, unverified loads by reason, mismatching
    block positions; labels not seen yet exist at 0. Catches verdicts that
    never reach /metrics or land under the wrong label."""
    producer, consumer = pd_pair
    run_three_loads(producer, consumer)
    logger = PrometheusStatLogger(consumer.vllm_config)
    record_all(logger, consumer)
    loads = "vllm:kv_checksum_loads_total"
    for verdict in VERDICT_LABELS:
        assert sample(loads, logger, verdict=verdict) == 1.0
    unverified = "vllm:kv_checksum_unverified_loads_total"
    assert sample(unverified, logger, reason=NO_CHECKSUMS) == 1.0
    for reason in REASON_LABELS.values():
        if reason != NO_CHECKSUMS:
            assert sample(unverified, logger, reason=reason) == 0.0
    assert sample("vllm:kv_checksum_mismatched_blocks_total", logger) == 1.0
    assert sample("vllm:kv_checksum_payloads_sent_total", logger) == 0.0


def test_prometheus_counts_producer_sends(pd_pair):
    """R130: a producer's sent payloads are counted; none was refused, so
    every not-sent reason reads 0. Catches sends counted on the wrong side."""
    producer, _ = pd_pair
    for i in range(3):
        produce(producer, f"p-{i}", prompt(i))
    logger = PrometheusStatLogger(producer.vllm_config)
    record_all(logger, producer)
    assert sample("vllm:kv_checksum_payloads_sent_total", logger) == 3.0
    for reason in REASON_LABELS.values():
        value = sample(
            "vllm:kv_checksum_payloads_not_sent_total", logger, reason=reason
        )
        assert value == 0.0
    assert sample("vllm:kv_checksum_loads_total", logger, verdict="verified") == 0.0


def test_prometheus_per_engine_labels(model_dir):
    """R130: with several DP engines behind one logger, counts go to the
    reporting engine's "engine" label only. Catches counters bound to engine
    0 regardless of engine_idx."""
    producer = SimEngine(model_dir, SideConfig(log_stats=True), "producer")
    produce(producer, "p-0", prompt(0))
    logger = PrometheusStatLogger(producer.vllm_config, engine_indexes=[0, 1])
    record_all(logger, producer, engine_idx=1)
    sent = "vllm:kv_checksum_payloads_sent_total"
    assert sample(sent, logger, engine=1) == 1.0
    assert sample(sent, logger, engine=0) == 0.0


def test_connector_parser_never_sees_checksum_key(pd_pair):
    """R130: the connector's own Prometheus parser gets kv_connector_stats
    without "kv_checksum" while the checksum counts are recorded; with the
    plugin it is also skipped when nothing else is left and gets untouched
    data when checksums added nothing. Catches connector parsers (NIXL's)
    crashing on an unknown key, and (in-tree) counts recorded only when the
    connector reported stats of its own."""
    producer, consumer = pd_pair
    run_three_loads(producer, consumer)
    logger = PrometheusStatLogger(consumer.vllm_config)
    seen: list[Any] = []

    class ConnectorMetrics:
        def observe(self, data: Any, engine_idx: int = 0) -> None:
            seen.append(data)

    prom = logger.kv_connector_prom
    prom.prom_metrics = ConnectorMetrics()  # type: ignore[assignment]
    stats = next(
        s for s in consumer.scheduler_stats if (checksum_data(s) or {}).get("loads")
    )
    loads = checksum_data(stats)["loads"]

    def recorded() -> dict[str, Any]:
        name = "vllm:kv_checksum_loads_total"
        return {v: sample(name, logger, verdict=v) for v in VERDICT_LABELS}

    theirs = {"num_successful_transfers": 2}
    stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), "Nixl": theirs}
    shared = stats.kv_connector_stats
    logger.record(scheduler_stats=stats, iteration_stats=None)
    assert seen == [{"Nixl": theirs}]
    assert recorded() == {v: loads.get(v, 0) for v in VERDICT_LABELS}
    if native_kv_checksums():
        stats.kv_connector_stats = None  # the connector reported nothing
        logger.record(scheduler_stats=stats, iteration_stats=None)
        assert len(seen) == 1
        assert recorded() == {v: 2 * loads.get(v, 0) for v in VERDICT_LABELS}
        return
    assert STATS_KEY in shared  # not mutated: other loggers still see it
    only_ours = {STATS_KEY: {"sent": 1}}
    prom.observe(only_ours, 0)
    assert len(seen) == 1
    plain = {"Nixl": theirs}
    prom.observe(plain, 0)
    assert seen[-1] is plain


def test_logging_stat_logger_strips_checksum_key(pd_pair, monkeypatch, caplog):
    """R130: vLLM's LoggingStatLogger records and logs SchedulerStats holding
    checksum counts without crashing, and the connector's
    build_kv_connector_stats never sees "kv_checksum" (it is not called when
    nothing else is left). Catches the API server's log loop failing on the
    checksum key."""
    producer, consumer = pd_pair
    run_three_loads(producer, consumer)
    logger = LoggingStatLogger(consumer.vllm_config)
    built: list[Any] = []
    connector_cls = logger.kv_connector_logging.connector_cls
    monkeypatch.setattr(
        connector_cls,
        "build_kv_connector_stats",
        classmethod(lambda cls, data=None: built.append(data)),
    )
    with caplog.at_level(logging.INFO):
        record_all(logger, consumer)
        logger.log()
    assert built == []
    if native_kv_checksums():
        return  # in-tree the key is never in kv_connector_stats: nothing to strip
    logger.kv_connector_logging.observe({STATS_KEY: {"sent": 1}, "Nixl": {"a": 1}})
    assert built == [{"Nixl": {"a": 1}}]


def test_disabled_checksums_register_no_metrics(model_dir):
    """R130 with R1: without enable_kv_checksum no checksum collector is
    registered and the connector's stats pass through unchanged. Catches
    metrics appearing on engines that never checksum."""
    engine = SimEngine(model_dir, SideConfig(enabled=False), "plain")
    logger = PrometheusStatLogger(engine.vllm_config)
    assert getattr(logger.kv_connector_prom, "kv_checksum_metrics", 0) is None
    names = {m.name for m in REGISTRY.collect()}
    assert not any(name.startswith("vllm:kv_checksum") for name in names)


@pytest.mark.kv_checksum_capability("containment")
def test_prometheus_counts_quarantined_blocks(model_dir):
    """R138, R130: a fail-open mismatch at the first of three loaded positions
    quarantines all three loaded blocks; the count travels in SchedulerStats
    and appears as vllm:kv_checksum_quarantined_blocks_total (0 on an engine
    without failed loads). Catches quarantines that never reach /metrics."""
    producer = SimEngine(model_dir, SideConfig(log_stats=True), "producer")
    consumer = SimEngine(model_dir, SideConfig(log_stats=True), "consumer")
    bad = produce(producer, "p-bad", prompt(1))
    consume(consumer, producer, "c-bad", prompt(1), bad, fault=Fault("bit_flip"))
    assert consumer.checksums.stats.quarantined_blocks == 0  # taken by make_stats
    total = sum(
        KVChecksumStats.from_dict(checksum_data(s)).quarantined_blocks
        for s in consumer.scheduler_stats
    )
    assert total == 3
    logger = PrometheusStatLogger(consumer.vllm_config)
    record_all(logger, consumer)
    assert sample("vllm:kv_checksum_quarantined_blocks_total", logger) == 3.0
    unregister_vllm_metrics()
    clean = PrometheusStatLogger(producer.vllm_config)
    record_all(clean, producer)
    assert sample("vllm:kv_checksum_quarantined_blocks_total", clean) == 0.0


def test_prometheus_counts_disabled_workers(model_dir):
    """R130, R134 (issue 32): a worker's "checksums disabled" record reaches
    the scheduler, which counts it once (a second record of the same worker
    adds nothing) and it appears as vllm:kv_checksum_disabled_workers_total
    (0 on an engine whose workers all run). Catches a disabled worker that
    operators cannot alert on."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumRecord,
    )

    consumer = SimEngine(model_dir, SideConfig(log_stats=True), "consumer")
    clean_engine = SimEngine(model_dir, SideConfig(log_stats=True), "clean")
    worker = consumer.workers[0].checksum
    marker = KVChecksumRecord(pp_rank=0, tp_rank=0, disabled=True)
    worker.post_forward = lambda *args, **kwargs: marker
    consumer.step()
    consumer.step()
    clean_engine.step()
    assert consumer.checksums.disabled_workers == {(0, 0)}
    logger = PrometheusStatLogger(consumer.vllm_config)
    record_all(logger, consumer)
    assert sample("vllm:kv_checksum_disabled_workers_total", logger) == 1.0
    unregister_vllm_metrics()
    clean = PrometheusStatLogger(clean_engine.vllm_config)
    record_all(clean, clean_engine)
    assert sample("vllm:kv_checksum_disabled_workers_total", clean) == 0.0


def tracked_series(engine: SimEngine) -> list[int]:
    """The tracked-requests values the engine's SchedulerStats carried, in order."""
    values = []
    for stats in engine.scheduler_stats:
        value = KVChecksumStats.from_dict(checksum_data(stats)).tracked_requests
        if value is not None:
            values.append(value)
    return values


def test_tracked_requests_gauge(pd_pair):
    """R141: the number of requests holding checksum state travels in
    SchedulerStats when it changes, is set on
    vllm:kv_checksum_tracked_requests, and is back at 0 once every request
    finished (3 consumer requests, one at a time: 1 -> 0 each). Catches
    a gauge that is never sent, sent as a delta (summed), or stuck above 0."""
    producer, consumer = pd_pair
    run_three_loads(producer, consumer)
    # Each request is noted on arrival: its first step already counts it.
    assert tracked_series(consumer) == [1, 0, 1, 0, 1, 0]  # sent on change only
    assert tracked_series(producer)[-1] == 0
    logger = PrometheusStatLogger(consumer.vllm_config)
    engine_stats = consumer.scheduler_stats
    for stats in engine_stats:
        logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        data = checksum_data(stats) or {}
        if data.get("tracked_requests") == 1:
            assert sample("vllm:kv_checksum_tracked_requests", logger) == 1.0
    assert sample("vllm:kv_checksum_tracked_requests", logger) == 0.0


def test_tracked_recount_schedule():
    """R141, R142: the gauge's recount runs when the engine drains, on the
    first step after, and every `every` busy steps between (expected by hand
    for every=4). Catches a recount that never runs while the engine stays
    busy (a frozen gauge) and one that runs only when the engine drains."""
    recount = TrackedRecount(every=4)
    empty = [False] * 9 + [True] + [False] * 2
    expected = [True, False, False, False, True, False, False, False, True]
    expected += [True, True, False]
    assert [recount.due(e) for e in empty] == expected


def test_tracked_requests_recounted_every_16_busy_steps(pd_pair, monkeypatch):
    """R141, R142: a consumer request decoding 30 tokens keeps its engine busy
    for more than 30 steps; the requests holding checksum state are recounted
    on at most one step in 16 (plus its start and end), not on every step,
    and the gauge still reads 1 while it runs and 0 after. Catches the
    recount on every step (a Python walk over every tracked request each
    step, R142)."""
    producer, consumer = pd_pair
    params = produce(producer, "p-long", prompt(0))
    kcs = consumer.scheduler.kv_checksum_scheduler
    recounts = []
    tracked = kcs.tracked_request_ids
    monkeypatch.setattr(
        kcs, "tracked_request_ids", lambda: recounts.append(1) or tracked()
    )
    consume(consumer, producer, "c-long", prompt(0), params, max_tokens=30)
    steps = len(consumer.scheduler_stats)
    assert steps > 30
    assert 2 <= len(recounts) <= steps // 16 + 2
    assert tracked_series(consumer) == [1, 0]


def test_tracked_requests_round_trip():
    """R141: the gauge's value crosses processes, 0 included (unlike the
    counts, 0 is a value to send); a malformed one reads as "unchanged".
    Catches a 0 dropped on the way, leaving the gauge stuck at its last
    non-zero value."""
    stats = KVChecksumStats(tracked_requests=0)
    assert not stats.is_empty()
    assert KVChecksumStats.from_dict(stats.to_dict()).tracked_requests == 0
    assert KVChecksumStats.from_dict({"tracked_requests": -1}).tracked_requests is None
    assert stats.take().tracked_requests == 0 and stats.tracked_requests is None
