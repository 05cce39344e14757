# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The chaos driver's pure logic on hand-made inputs, and its process and
client handling against the fake server (issue 27; the driver proves R141's
bounded state and R138's containment under process faults on the GPU host,
these tests keep its planning and verdicts honest)."""

import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = ROOT / "examples/disaggregated"
FAKE = Path(__file__).resolve().parent / "kv_checksum_fake_server.py"


plan = load_script("kv_checksum_chaos_plan", EXAMPLES / "kv_checksum_chaos_plan.py")
chaos = load_script("kv_checksum_chaos", EXAMPLES / "kv_checksum_chaos.py")
ROUTER_ID = "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_ab12"


def test_mismatch_ids_keep_router_colons() -> None:
    """Bug caught: a non-greedy id pattern cut vllm-router's request ids at
    their first colon, so no mismatch id equalled its injection id and every
    injected fault counted as a false mismatch (seen in the fake dry run)."""
    log = (
        f"WARNING KV checksum fault injection: bitflip into request {ROUTER_ID} "
        "group 0 block position 3\n"
        f"ERROR 12-01 [verdict_log.py:64] KV checksum mismatch for request "
        f"{ROUTER_ID}: [0]\n"
    )
    assert plan.request_ids(plan.MISMATCH, log) == {ROUTER_ID}
    assert plan.request_ids(plan.INJECTED, log) == {ROUTER_ID}


def test_plan_aborts_exact_share_every_phase() -> None:
    """Bug caught: aborts drawn by a coin per request (the soak's 5 % off by
    chance) or a phase never planned (a window of R141 never hit)."""
    plans = plan.plan_aborts(100, 0.05, ttft_ms=80.0, max_tokens=16, seed=1)
    assert len(plans) == 100 and sum(p is not None for p in plans) == 5
    plans = plan.plan_aborts(40, 0.5, ttft_ms=80.0, max_tokens=16, seed=2)
    chosen = [p for p in plans if p is not None]
    assert len(chosen) == 20
    assert {p.phase: sum(q.phase == p.phase for q in chosen) for p in chosen} == {
        "before_load": 5,
        "during_load": 5,
        "before_verify": 5,
        "during_decode": 5,
    }
    for p in chosen:
        if p.phase == "during_decode":
            assert p.after_ms is None and 1 <= p.after_chunks <= 15
        else:
            lo, hi = {"before_load": (0, 24), "during_load": (24, 56)}.get(
                p.phase, (56, 80)
            )
            assert p.after_chunks is None and lo <= p.after_ms <= hi


def test_plan_offsets_cover_the_window() -> None:
    """Bug caught: every repeat killing at the same moment, so one in-flight
    window is hit `repeats` times and the others never."""
    offsets = plan.plan_offsets(4, 2.0, seed=3)
    for i, offset in enumerate(offsets):
        assert 0.5 * i <= offset < 0.5 * (i + 1)


def test_classify_cut_stream_and_wrong_text() -> None:
    """Bug caught: a 200 whose stream broke off (text None) or whose text is
    not a reference counted as right; an abort counted as an error."""
    right = {"a b"}
    assert plan.classify(plan.Outcome(200, "a b"), right) == "right"
    assert plan.classify(plan.Outcome(200, "a"), right) == "wrong"
    assert plan.classify(plan.Outcome(200, None, error="cut"), right) == "error"
    assert plan.classify(plan.Outcome(0, None), right) == "error"
    assert plan.classify(plan.Outcome(0, None, hung=True), right) == "hang"
    assert plan.classify(plan.Outcome(0, None, aborted=True), right) == "aborted"


def test_gauge_total_sums_labels_and_reports_absence() -> None:
    """Bug caught: the gauge read from one label set only (a second engine's
    state missed), a prefixed metric counted in, or absence read as 0."""
    page = (
        "# HELP vllm:kv_checksum_tracked_requests requests with state\n"
        'vllm:kv_checksum_tracked_requests{engine="0"} 2.0\n'
        'vllm:kv_checksum_tracked_requests{engine="1"} 3.0\n'
        'vllm:kv_checksum_tracked_requests_created{engine="0"} 1.7e9\n'
    )
    assert plan.gauge_total(page) == 5.0
    assert plan.gauge_total("vllm:other 1.0\n") is None
    assert plan.gauge_back_to_zero(None) is None
    assert plan.gauge_back_to_zero(0.0) is True
    assert plan.gauge_back_to_zero(1.0) is False


def test_unexpected_errors_skip_mismatches_only() -> None:
    """Bug caught: expected mismatch reports counted as checksum errors (every
    soak fails), or an exception inside the package not counted."""
    log = "\n".join(
        [
            f"ERROR [x.py:64] KV checksum mismatch for request {ROUTER_ID}: 0",
            "WARNING KV checksum fault injection: bitflip into request r1 group 0",
            "ERROR [wiring.py:10] KV checksum payload of request r2 unreadable",
            '  File "/site/vllm/distributed/kv_transfer/kv_checksum/wiring.py", line 3',
            "ERROR [scheduler.py:1] something else",
        ]
    )
    found = plan.unexpected_errors(log)
    assert len(found) == 2
    assert "unreadable" in found[0] and "wiring.py" in found[1]


def test_fit_slope_skips_warmup_and_sees_a_leak() -> None:
    """Bug caught: the warm-up ramp fitted in (a flat engine reported as
    leaking) or a steady leak reported flat."""
    warm = [
        (float(t), 1000.0 + (500.0 if t >= 60 else t * 8)) for t in range(0, 600, 5)
    ]
    fit = plan.fit_slope(warm, warmup_fraction=0.25)
    assert fit.slope_per_min == pytest.approx(0.0, abs=1e-9)
    assert fit.flat is True
    leak = [(float(t), 2000.0 + t / 60 * 40.0) for t in range(0, 600, 5)]
    fit = plan.fit_slope(leak, warmup_fraction=0.25)
    assert fit.slope_per_min == pytest.approx(40.0, rel=1e-6)
    assert fit.flat is False  # 40 MiB/min over 7.4 min > max(64, 40)
    assert plan.fit_slope([(0.0, 1.0), (1.0, 2.0)]).flat is None


def _counts(**kw: int) -> dict[str, int]:
    return {**dict.fromkeys(("right", "wrong", "error", "hang", "aborted"), 0), **kw}


def test_judge_soak() -> None:
    """Bug caught: a mismatch without an injection (a false mismatch)
    passing; injected faults unreported beyond what aborts explain passing;
    a gauge left at 3 passing; a missing gauge (n/a) failing."""
    flat = {"consumer rss_mib": plan.SlopeFit(0.1, 900.0, 5.0, 50, True)}
    args = dict(gauges={"consumer": 0.0, "producer": None}, memory=flat, errors=[])
    ok = plan.judge_soak(_counts(right=95, aborted=5), {"a", "b"}, {"a"}, **args)
    assert ok.passed, ok.checks
    false = plan.judge_soak(_counts(right=100), {"a"}, {"a", "x"}, **args)
    assert not false.passed and false.counts["false_mismatches"] == 1
    lost = plan.judge_soak(_counts(right=99, aborted=1), {"a", "b", "c"}, {"a"}, **args)
    assert not lost.passed
    answered = plan.judge_soak(
        _counts(right=95, aborted=5), {"a", "b"}, {"a"}, **args, answered={"b"}
    )
    assert not answered.passed and answered.counts["unreported_answered"] == ["b"]
    args["gauges"] = {"consumer": 3.0}
    assert not plan.judge_soak(_counts(right=1), {"a"}, {"a"}, **args).passed


def test_injections_without_effect_leave_the_injected_set() -> None:
    """R131: an injection the injector logged as without effect (its copy
    source held the same bytes) is no fault to report, unless a mismatch was
    reported for it all the same (another worker's shard changed). Bugs
    caught: a no-op copy failing the soak as an unreported fault (2026-12-01e,
    one of 367); a reported no-op-on-rank-0 injection dropped, which would make
    its mismatch look false; the no-effect line counted as a second injection."""
    a, b, c = (f"cmpl-{x}-0-0123abcd" for x in "abc")
    log = "".join(
        f"WARNING KV checksum fault injection: stale_block into request {r} "
        "group 0 block position 3.\n"
        for r in (a, b, c)
    ) + "".join(
        f"WARNING KV checksum fault injection had no effect: stale_block into "
        f"request {r} group 0 block position 3 copied block 9, which held the "
        "same bytes on this worker; no fault to report.\n"
        for r in (a, b)
    )
    log += f"ERROR KV checksum mismatch for request {b}: group 0 block positions [3]\n"
    assert plan.request_ids(plan.INJECTED, log) == {a, b, c}
    assert plan.effective_injections(log) == ({b, c}, {a})


def test_judge_soak_fail_policy_control() -> None:
    """R131, R141 soak: the fail-policy control (no recompute ever shares the consumer's
    batch): a run whose answers all equal the references and whose errors are at most
    its reported mismatches passes; one alternate answer fails it, and so do more errors
    than mismatches (bugs caught: the control judged like the recompute soak, where
    alternates are allowed, so it could not refute "alternates come from recomputes";
    errors that no mismatch explains)."""
    flat = {"consumer rss_mib": plan.SlopeFit(0.1, 900.0, 5.0, 50, True)}
    args = dict(gauges={"consumer": 0.0}, memory=flat, errors=[], policy="fail")
    ok = plan.judge_soak(
        _counts(right=97, error=2, aborted=1), {"a", "b"}, {"a", "b"}, **args
    )
    assert ok.passed, ok.checks
    assert ok.counts["policy"] == "fail"
    alternate = _counts(right=96, alternate=1, error=2, aborted=1)
    assert not plan.judge_soak(alternate, {"a", "b"}, {"a", "b"}, **args).passed
    errors = _counts(right=96, error=3, aborted=1)
    assert not plan.judge_soak(errors, {"a", "b"}, {"a", "b"}, **args).passed
    # The recompute soak allows alternates (they are counted apart).
    args["policy"] = "recompute"
    assert plan.judge_soak(alternate, {"a", "b"}, {"a", "b"}, **args).passed


def test_soak_consumer_setup() -> None:
    """R131 soak: the consumer gets the injector and --soak-policy, and restarts
    only when one of them changed. Bugs caught: the fail policy never applied
    when the consumer already had its injector (a soak-only run without mixed
    references), so the "fail" control ran with recomputes; a needless restart;
    the checksums-off control given a policy."""
    spec = plan.ServerSpec("consumer", 8200, 5700, "consumer", policy="recompute")
    assert plan.soak_consumer(spec, 0.01, "recompute", "on") is True
    assert (spec.faults, spec.policy) == (0.01, "recompute")
    assert plan.soak_consumer(spec, 0.01, "recompute", "on") is False
    assert plan.soak_consumer(spec, 0.01, "fail", "on") is True
    assert spec.policy == "fail"
    off = plan.ServerSpec("consumer", 8200, 5700, "consumer", policy="recompute")
    assert plan.soak_consumer(off, 0.0, "fail", "off") is False
    assert off.policy == "recompute" and off.faults == 0.0


def test_judge_lease_expiry_and_producer_kill() -> None:
    """Bug caught: an unreported stale load (a wrong 200) passing; a consumer
    counting more verified loads than right answers (a broken load verified)
    passing; a run without any mismatch passing as the incident."""
    good = plan.judge_lease_expiry([True, False], ["right", "right"], stale_reads=1)
    assert good.passed
    silent = plan.judge_lease_expiry([True, False], ["right", "wrong"], 1)
    assert not silent.passed and silent.counts["unreported_wrong"] == 1
    assert not plan.judge_lease_expiry([False, False], ["right", "right"], 0).passed
    outcomes = {"recompute": _counts(right=10, error=22), "fail": _counts(right=8)}
    fresh = {"recompute": True, "fail": True}
    ok = plan.judge_producer_kill(outcomes, {"recompute": 10, "fail": 8}, fresh, [])
    assert ok.passed, ok.checks
    over = plan.judge_producer_kill(outcomes, {"recompute": 11, "fail": 8}, fresh, [])
    assert not over.passed


def test_topology_and_configs() -> None:
    """Bug caught: the injector on while the other scenarios run (their
    mismatches false), the fail-policy consumer missing for producer_kill, or
    the offload tier's MultiConnector losing the NIXL connector."""
    soak = plan.plan_topology(["soak"], 20, 2, 0.01)
    assert soak.server("consumer").faults == 0.01
    assert [r.name for r in soak.routers] == ["router"]
    both = plan.plan_topology(["producer_kill", "soak"], 20, 2, 0.01)
    assert both.server("consumer").faults == 0.0
    fail = plan.kv_transfer_config(both.server("consumer_fail"), "nixl-pull")
    assert fail["kv_load_failure_policy"] == "fail"
    assert fail["kv_connector_extra_config"]["kv_checksum_fail_closed"] is True
    assert both.server("producer").lease_s == 20
    lease = plan.plan_topology(["lease_expiry"], 20, 2, 0.01).server("producer_lease")
    assert (lease.lease_s, lease.num_blocks) == (2, 256)
    offload = plan.kv_transfer_config(soak.server("consumer"), "nixl-offload")
    assert offload["kv_connector"] == "MultiConnector"
    inner = offload["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in inner] == [
        "NixlConnector",
        "OffloadingConnector",
    ]
    push = plan.kv_transfer_config(soak.server("producer"), "nixl-push")
    assert push["kv_connector"] == "NixlPushConnector"
    with pytest.raises(ValueError):
        plan.plan_topology(["nap"], 20, 2, 0.01)


def _ports(topology: Any) -> list[int]:
    return [p for s in topology.servers for p in (s.port, s.side_port)] + [
        p for r in topology.routers for p in (r.port, r.prom_port)
    ]


def test_shifted_topologies_share_no_port() -> None:
    """Bug caught: a port left out of the shift (say the NIXL side channel or
    the router's metrics port), so two drivers that gpu_runs.sh `group` starts
    on one host bind the same port and one of them fails to start."""
    every = ["producer_kill", "client_abort", "consumer_restart", "lease_expiry"]
    base = plan.plan_topology(every, 20, 2, 0.01)
    offsets = (0, 1000, 10000, 11000, 12000, 13000)
    seen: list[int] = []
    for offset in offsets:
        shifted = plan.shift_ports(base, offset)
        assert _ports(shifted) == [p + offset for p in _ports(base)]
        assert [s.name for s in shifted.servers] == [s.name for s in base.servers]
        seen += _ports(shifted)
    assert len(seen) == len(set(seen))
    assert _ports(plan.shift_ports(base, 0)) == _ports(base)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fake_server_kill_restart_and_abort(tmp_path: Path) -> None:
    """The driver's process and client handling end to end on the fake server
    (no router, no timing): a full stream's text is the fake model's answer,
    an abort after 2 chunks is an abort, a SIGKILLed server answers nothing,
    a restart serves again, and the in-flight gauge is back to 0.

    Bug caught: kill() leaving the group alive (the restart's port busy),
    an abort counted as an answer, or a dead server counted as a hang."""
    fake = load_script("kv_checksum_fake_server", FAKE)
    port = _free_port()
    env = dict(__import__("os").environ, FAKE_TRACKED_GAUGE="1")
    proc = chaos.Proc(
        "fake",
        [sys.executable, str(FAKE), "serve", "m", "--port", str(port)],
        env,
        port,
        tmp_path,
    )
    proc.start()
    try:
        assert proc.wait_healthy(60)
        payload = {"prompt": "t5 t6", "max_tokens": 4, "stream": True}
        full = chaos.complete(proc.url, payload, timeout=30)
        assert full.status == 200 and full.text == "".join(fake.words("t5 t6", 4))
        cut = chaos.complete(
            proc.url, payload, 30, plan.AbortPlan("during_decode", after_chunks=2)
        )
        assert cut.aborted and cut.text is None
        proc.kill(signal.SIGKILL)
        dead = chaos.complete(proc.url, payload, timeout=30)
        assert dead.status == 0 and not dead.hung and not dead.aborted
        proc.start()
        assert proc.wait_healthy(60)
        again = chaos.complete(proc.url, dict(payload, stream=False), timeout=30)
        assert again.text == full.text
        assert chaos.Run.wait_gauge_zero(_GaugeRun(proc), "fake", 30) == 0.0
        # The restarted server answered one request: the kill trigger of
        # producer_kill reads that counter (bug: the wrong metric name, so the
        # kill waits out its timeout and lands after every load).
        runner = _GaugeRun(proc)
        assert chaos.Run.wait_answered(runner, "fake", 1, timeout=30) < 30
    finally:
        proc.kill(signal.SIGTERM)


class _GaugeRun:
    """Just what Run.wait_gauge_zero and wait_answered need: gauge(name),
    procs."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

        self.procs = {"fake": proc}

    def gauge(self, name: str) -> float | None:
        return plan.gauge_total(self.proc.metrics())


def test_completion_id_of_engine_ids() -> None:
    """The consumer logs vLLM's engine id (completion id, "-<index>" for
    completions, a random "-<8 hex>"); ids from the H200 soak's logs.

    Bug caught: engine ids compared to the client's completion ids as they
    are (no wrong answer ever matched its own mismatch line), or a chat id
    losing a "-<digits>" of its own."""
    soak = f"cmpl-{ROUTER_ID}d34d3e5d235044e48a968ae3283d2d34"
    assert plan.completion_id(f"{soak}-0-b71db729") == soak
    assert plan.completion_id("cmpl-stale-0-a5e8db85-0-a5080a99") == (
        "cmpl-stale-0-a5e8db85"
    )
    assert plan.completion_id("chatcmpl-stale-3-0badf00d") == "chatcmpl-stale-3"


def _log(rid: str, inject: str = "", quarantine: bool = False) -> str:
    """The consumer's lines for one mismatched load of completion `rid`."""
    eid = f"{rid}-0-1a2b3c4d"
    lines = []
    if inject:
        lines.append(
            f"WARNING 12-01 06:44:43 [injector.py:294] KV checksum fault injection: "
            f"{inject} into request {eid} group 0 block position 2."
        )
    lines.append(
        f"ERROR 12-01 06:44:43 [verdict_log.py:64] KV checksum mismatch for "
        f"request {eid}: group 0 block positions [2]"
    )
    if quarantine:
        lines.append(
            f"INFO 12-01 06:44:43 [containment.py:194] KV checksums: quarantined "
            f"3 loaded blocks of request {eid} (group 0 from block position 2): "
            "kept out of the prefix cache."
        )
    return "\n".join(lines)


def test_attribute_wrong_answers() -> None:
    """R138 (a failed load never serves wrong KV): each wrong answer of a run
    attributed by hand from made-up outcomes and consumer lines: own fault
    injected, own load mismatched, a same-prompt request mismatched before it
    finished (contamination, nearest such send), or unexplained (the only
    same-prompt mismatch was sent after it finished).

    Bug caught: a wrong answer whose own load mismatched counted as
    contamination, a sibling sent after the wrong answer finished counted as
    its cause, the farther sibling's gap reported, or right/aborted answers
    counted as wrong."""
    rid = {k: f"cmpl-{ROUTER_ID}{k}" for k in ("r1", "r2", "r3", "r4", "r5", "r6")}
    refs = [{"A"}, {"B"}, {"C"}]

    def out(k: str, prompt: int, text: str, sent: float, done: float) -> Any:
        return plan.Outcome(
            200, text, prompt=prompt, request_id=rid[k], sent_s=sent, finished_s=done
        )

    outcomes = [
        out("r1", 0, "A", 1.0, 2.0),  # injected, recomputed right
        out("r2", 0, "X", 2.0, 3.0),  # injected, wrong
        out("r3", 1, "Y", 0.5, 4.0),  # mismatched without injection, wrong
        out("r4", 0, "Z" * 300, 5.0, 6.0),  # clean load, wrong: r2 sent 4 s before
        out("r5", 2, "W", 6.5, 7.0),  # clean load, wrong, r6 sent after
        out("r6", 2, "C", 10.0, 11.0),  # mismatched, right
        plan.Outcome(0, None, aborted=True, prompt=1),
    ]
    log_text = "\n".join(
        [
            _log(rid["r1"], "swap_blocks"),
            _log(rid["r2"], "zero_block", quarantine=True),
            _log(rid["r3"]),
            _log(rid["r6"]),
            _log("cmpl-not-the-drivers"),
        ]
    )
    found = plan.attribute_wrong(outcomes, refs, log_text, examples=3, texts=4)
    assert found["wrong"] == 4
    assert found["by_cause"] == {
        "injected": 1,
        "mismatched": 1,
        "same_prompt_mismatch": 1,
        "unexplained": 1,
    }
    assert found["by_prompt"] == {"0": 2, "1": 1, "2": 1}
    assert found["injected_by_kind"] == {
        "swap_blocks": {"right": 1},
        "zero_block": {"wrong": 1},
    }
    assert (found["unmatched_injected"], found["unmatched_mismatches"]) == (0, 1)
    assert len(found["examples"]) == 3
    r2, r3, r4 = found["examples"]
    assert (r2["cause"], r2["injected_kind"], r2["quarantined"]) == (
        "injected",
        "zero_block",
        True,
    )
    assert (r3["cause"], r3["quarantined"]) == ("mismatched", False)
    assert (r4["cause"], r4["sibling"], r4["gap_s"]) == (
        "same_prompt_mismatch",
        rid["r2"],
        4.0,
    )
    texts = found["texts"]
    assert [t["request_id"] for t in texts] == [
        rid[k] for k in ("r2", "r3", "r4", "r5")
    ]
    assert texts[0]["references"] == ["A"] and texts[0]["text"] == "X"
    assert texts[2]["text"] == "Z" * 200
    assert texts[3]["cause"] == "unexplained"


def test_soak_dry_run_attributes_wrong_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak end to end on CPU (fake servers and router, one prompt, no
    aborts, injector rate 0.1: loads 10 and 20 faulted); the fake consumer
    answers loads 10 and 13 wrong. Its summary must attribute one wrong
    answer to its own injected fault and one to the earlier mismatch of the
    same prompt, and keep every outcome in outcomes_soak.jsonl.

    Bug caught: the driver losing the response ids (streamed chunks' id)
    or its outcomes' times, so no wrong answer maps to the log."""
    from tests.v1.kv_connector.unit.test_kv_checksum_tamper import _free_offset

    monkeypatch.setenv("FAKE_WRONG_LOADS", "10,13")
    fake = f"{chaos.sys.executable} {FAKE}"
    argv = ["--out", str(tmp_path), "--scenarios", "soak", "--no-build"]
    argv += ["--serve-cmd", fake, "--router-cmd", f"{fake} router"]
    argv += ["--num-prompts", "1", "--soak-requests", "20"]
    argv += ["--soak-concurrency", "4", "--soak-abort-rate", "0"]
    argv += ["--soak-fault-rate", "0.1", "--sample-s", "0.2"]
    argv += ["--startup-timeout", "120", "--lease", "1"]
    # No mixed references: the wrong loads' numbers count the soak's loads.
    argv += ["--mixed-repeats", "0"]
    offset = _free_offset(plan.plan_topology(["soak"], 20, 2, 0.1))
    assert chaos.main([*argv, "--port-offset", str(offset)]) == 1  # 2 wrong
    entry = json.loads((tmp_path / "summary.json").read_text())["scenarios"]["soak"]
    assert entry["counts"]["outcomes"]["wrong"] == 2, entry
    assert entry["checks"]["0 false mismatches"]
    found = entry["counts"]["attribution"]
    assert found["by_cause"] == {
        "injected": 1,
        "mismatched": 0,
        "same_prompt_mismatch": 1,
        "unexplained": 0,
    }
    assert found["by_prompt"] == {"0": 2}
    assert found["injected_by_kind"] == {"bitflip": {"wrong": 1, "right": 1}}
    assert (found["unmatched_injected"], found["unmatched_mismatches"]) == (0, 0)
    # Either may come first: the outcomes keep send order, not load order.
    by_cause = {w["cause"]: w for w in found["examples"]}
    contaminated = by_cause["same_prompt_mismatch"]
    assert contaminated["sibling"] == by_cause["injected"]["request_id"]
    assert contaminated["gap_s"] >= 0
    lines = (tmp_path / "outcomes_soak.jsonl").read_text().splitlines()
    assert len(lines) == 20


def test_soak_plot_series_per_server() -> None:
    """The soak plot's curves: one server's samples of one key, in time
    order, unknown values left out (bug: another server's samples mixed in,
    or a None sample plotted as a drop to 0)."""
    from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

    plot = load_script(
        "plot_kv_checksum_soak", ROOT / "benchmarks/plot_kv_checksum_soak.py"
    )
    samples = [
        {"t": 1.0, "server": "producer", "rss_mib": 10.0, "tracked": 0.0},
        {"t": 1.1, "server": "consumer", "rss_mib": 20.0, "tracked": 3.0},
        {"t": 2.0, "server": "producer", "rss_mib": None, "tracked": 1.0},
        {"t": 3.0, "server": "producer", "rss_mib": 12.0, "tracked": 0.0},
    ]
    assert plot.series(samples, "producer", "rss_mib") == ([1.0, 3.0], [10.0, 12.0])
    assert plot.series(samples, "consumer", "tracked") == ([1.1], [3.0])


def test_first_divergence_against_the_closest_reference() -> None:
    """Where a wrong answer leaves its references, by words: the closest
    reference counts (bug: the first reference only, so a near-tie of the
    second reads as wrong from the first word)."""
    refs = {"t1 t2 t3 t4", "t1 t9 t3 t4"}
    assert plan.first_divergence("t7 t2 t3 t4", refs) == 0
    assert plan.first_divergence("t1 t9 t5 t4", refs) == 2
    assert plan.first_divergence("t1 t2 t3 t8", refs) == 3
    assert plan.first_divergence("", refs) == 0


def test_in_stream_error_event_is_an_error_not_a_wrong_answer() -> None:
    """vLLM answers a request that kv_load_failure_policy "fail" ended with
    HTTP 200, one `data: {"error": ...}` event and [DONE] (its
    GenerationError path). Bug caught (H200, 2026-12-01): the driver read that
    stream as an empty answer, so 44 requests the fail policy had failed as it
    should counted as wrong answers."""
    import http.server
    import threading

    error = {"message": "Internal server error", "code": 500}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # as vLLM's server: the socket stays open

        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            stream = json.loads(self.rfile.read(length)).get("stream")
            body = json.dumps({"error": error}).encode()
            if stream:
                body = b"data: " + body + b"\n\ndata: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for stream in (True, False):
            payload = {"prompt": "t5", "max_tokens": 4, "stream": stream}
            out = chaos.complete(url, payload, timeout=30)
            assert out.status == 200 and out.text is None
            assert "Internal server error" in out.error
            assert plan.classify(out, {""}) == "error"
    finally:
        server.shutdown()


def test_classify_and_tally_alternates() -> None:
    """A text among the references is right, among the measured alternates
    "alternate", anywhere else wrong; tally counts each class and a judge
    still fails on one wrong answer beside alternates.

    Bugs caught: alternates counted as right (the second regime hidden from
    the summary), alternates counted as wrong (the H200 soak's 346 "wrong"
    answers that are near-tie continuations), a wrong answer passing once
    alternates exist, or old callers (no alternates) breaking."""
    refs, alts = [{"a b"}, {"c d"}], [{"a x"}, set()]
    assert plan.classify(plan.Outcome(200, "a b"), refs[0], alts[0]) == "right"
    assert plan.classify(plan.Outcome(200, "a x"), refs[0], alts[0]) == "alternate"
    assert plan.classify(plan.Outcome(200, "a y"), refs[0], alts[0]) == "wrong"
    assert plan.classify(plan.Outcome(200, "a x"), refs[0]) == "wrong"
    # An error stays an error even if its (absent) text could match nothing.
    assert plan.classify(plan.Outcome(0, None), refs[0], alts[0]) == "error"
    outcomes = [
        plan.Outcome(200, "a b", prompt=0),
        plan.Outcome(200, "a x", prompt=0),
        plan.Outcome(200, "a x", prompt=1),  # prompt 0's alternate, not 1's
        plan.Outcome(0, None, aborted=True, prompt=1),
    ]
    counts = plan.tally(outcomes, refs, alts)
    assert counts == {
        "right": 1,
        "alternate": 1,
        "wrong": 1,
        "error": 0,
        "hang": 0,
        "aborted": 1,
    }
    assert [o.cls for o in outcomes] == ["right", "alternate", "wrong", "aborted"]
    assert plan.tally(outcomes, refs)["wrong"] == 2  # default: no alternates
    flat = {"consumer rss_mib": plan.SlopeFit(0.1, 900.0, 5.0, 50, True)}
    args = dict(gauges={"consumer": 0.0}, memory=flat, errors=[])
    assert not plan.judge_soak(counts, {"i"}, {"i"}, **args).passed
    clean = dict(counts, wrong=0)
    ok = plan.judge_soak(clean, {"i"}, {"i"}, **args)
    assert ok.passed and ok.counts["outcomes"]["alternate"] == 1
    # A recomputed (reported) stale load may give the alternate; a wrong one
    # still fails, and the alternates are counted.
    lease = plan.judge_lease_expiry([True, True], ["right", "alternate"], 1)
    assert lease.passed and lease.counts["alternate"] == 1
    assert not plan.judge_lease_expiry([True, False], ["alternate", "wrong"], 1).passed
    kill = {"recompute": _counts(right=6, alternate=2), "fail": _counts(right=8)}
    fresh = {"recompute": True, "fail": True}
    verified = {"recompute": 8, "fail": 8}
    assert plan.judge_producer_kill(kill, verified, fresh, []).passed
    kill["recompute"]["wrong"] = 1
    assert not plan.judge_producer_kill(kill, verified, fresh, []).passed


def test_attribute_wrong_skips_alternates() -> None:
    """Bug caught: attribute_wrong counting an alternate as a wrong answer
    (its cause "unexplained"), so the H200 soak's near-tie continuations read
    as unexplained corruption; the alternate is counted apart."""
    refs, alts = [{"A"}], [{"B"}]
    outcomes = [
        plan.Outcome(200, "A", prompt=0, request_id="cmpl-1"),
        plan.Outcome(200, "B", prompt=0, request_id="cmpl-2"),
        plan.Outcome(200, "C", prompt=0, request_id="cmpl-3"),
    ]
    found = plan.attribute_wrong(outcomes, refs, "", alternates=alts)
    assert (found["wrong"], found["alternate"]) == (1, 1)
    assert [t["text"] for t in found["texts"]] == ["C"]
    assert plan.attribute_wrong(outcomes, refs, "")["wrong"] == 2


def test_collect_alternates_keeps_non_reference_answers() -> None:
    """Per prompt, each answered text that is no reference, once; errors,
    aborts and reference texts are none (bugs: an error's None text or a
    reference stored as an alternate, or one prompt's text under another)."""
    refs = [{"A"}, {"B"}, {"C"}]
    outcomes = [
        plan.Outcome(200, "A", prompt=0),
        plan.Outcome(200, "A2", prompt=0),
        plan.Outcome(200, "A2", prompt=0),
        plan.Outcome(200, "B2", prompt=1),
        plan.Outcome(200, "B3", prompt=1),
        plan.Outcome(500, None, prompt=2),
        plan.Outcome(0, None, aborted=True, prompt=2),
    ]
    assert plan.collect_alternates(outcomes, refs) == [{"A2"}, {"B2", "B3"}, set()]


def test_mixed_references_dry_run_injector_off_then_alternates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soak-only run on CPU (fake servers and router, one prompt, mixed
    references on, injector rate 0.1). The fake consumer answers loads 4 and
    13 with one other text: in the first consumer process load 4 is the
    second of the four mixed-reference loads (1 reference and 1 TTFT load
    before; there is no load 13), so that text becomes prompt 0's alternate;
    after the soak's restart loads 4 and 13 give it again and count as
    "alternate", not wrong (loads 10 and 20 get the injector's faults).

    Bugs caught: the mixed step run with the injector on (a soak-only run
    starts the consumer with it: its faults would then shape the alternates),
    the soak not restarting the consumer with its injector afterwards,
    alternates not threaded into the soak's tally (2 wrong answers), or the
    summary lacking the alternates per prompt."""
    from tests.v1.kv_connector.unit.test_kv_checksum_tamper import _free_offset

    monkeypatch.setenv("FAKE_WRONG_LOADS", "4,13")
    fake = f"{chaos.sys.executable} {FAKE}"
    argv = ["--out", str(tmp_path), "--scenarios", "soak", "--no-build"]
    argv += ["--serve-cmd", fake, "--router-cmd", f"{fake} router"]
    argv += ["--num-prompts", "1", "--soak-requests", "20", "--mixed-repeats", "4"]
    argv += ["--soak-concurrency", "4", "--soak-abort-rate", "0"]
    argv += ["--soak-fault-rate", "0.1", "--sample-s", "0.2"]
    argv += ["--startup-timeout", "120", "--lease", "1"]
    offset = _free_offset(plan.plan_topology(["soak"], 20, 2, 0.1))
    chaos.main([*argv, "--port-offset", str(offset)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["alternates"] == {"0": 1}
    entry = summary["scenarios"]["soak"]
    outcomes = entry["counts"]["outcomes"]
    assert (outcomes["wrong"], outcomes["alternate"], outcomes["right"]) == (0, 2, 18)
    assert entry["checks"]["no wrong answer"]
    assert entry["checks"]["faults were injected"]
    assert entry["counts"]["attribution"]["alternate"] == 2
    first, second = (tmp_path / "consumer.log").read_text().split("=== start 1")
    assert "kv_checksum_fault_injection" not in first.split("\n", 2)[1]
    assert "fault injection:" not in first
    assert "kv_checksum_fault_injection" in second.split("\n", 1)[0]
    assert "fault injection:" in second
