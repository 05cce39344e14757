# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tamper proxy's rewriting, the tamper judge and a CPU dry run of the
chaos driver's tamper scenario (issue 26 item 5: a router or client that
drops or alters kv_checksums gets unverified or mismatch, never verified and
never an HTTP error it would not get without checksums; R79, R94, R95, R96)."""

import base64
import copy
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from tests.v1.kv_connector.unit.test_kv_checksum_chaos_driver import (
    EXAMPLES,
    FAKE,
    chaos,
    plan,
)

proxy = load_script(
    "kv_checksum_tamper_proxy", EXAMPLES / "kv_checksum_tamper_proxy.py"
)
A = base64.b64encode(bytes(range(24))).decode()  # 32 characters
B = base64.b64encode(bytes(range(100, 124))).decode()


def _reply(value: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "p"}
    if value is not None:
        params["kv_checksums"] = value
    return {"choices": [{"text": " t5"}], "kv_transfer_params": params}


def test_proxy_rewrites_each_mode() -> None:
    """Each mode against a hand-built expected reply, R79's hostile inputs.

    Bug caught: drop leaving the key (or removing the whole params), truncate
    keeping the value whole, other passing the request's own value (or one of
    the same prompt, which verifies), garbage changing the length or type, a
    tampered reply left uncounted, or a reply without checksums altered."""
    t = proxy.Tamperer(seed=1)
    first, second = {"prompt": "t5 t6"}, {"prompt": "t7 t8"}
    assert t.rewrite(first, _reply(A)) == _reply(A)
    t.set_mode("drop")
    assert t.rewrite(second, _reply(B)) == {
        "choices": [{"text": " t5"}],
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p"},
    }
    t.set_mode("truncate")
    assert t.rewrite(second, _reply(B)) == _reply(B[:16])
    t.set_mode("other")
    # The latest value of another prompt: A (first), never B (this prompt's).
    assert t.rewrite(second, _reply(B)) == _reply(A)
    # Chat messages with the same text are the same prompt: still A.
    assert t.rewrite({"messages": [{"content": "t7 t8"}]}, _reply(B)) == _reply(A)
    t.set_mode("garbage")
    out = t.rewrite(second, _reply(B))["kv_transfer_params"]["kv_checksums"]
    assert isinstance(out, str) and len(out) == len(B) and out != B
    assert len(base64.b64decode(out, validate=True)) == 24
    untouched = {"choices": [], "kv_transfer_params": {"do_remote_prefill": True}}
    assert t.rewrite(second, copy.deepcopy(untouched)) == untouched
    assert t.state() == {
        "mode": "garbage",
        "counts": {"none": 1, "drop": 1, "truncate": 1, "other": 2, "garbage": 1},
    }


def test_proxy_other_without_history_passes() -> None:
    """Bug caught: `other` sending the request's own checksums (verified, a
    false "tamper passed") when no different request was seen; it must pass
    the reply unchanged and not count it, so the judge sees the gap."""
    t = proxy.Tamperer()
    t.set_mode("other")
    assert t.rewrite({"prompt": "t5"}, _reply(A)) == _reply(A)
    assert t.rewrite({"prompt": "t5"}, _reply(A)) == _reply(A)
    assert t.state()["counts"]["other"] == 0


def _phase(mode: str, sent: int = 4, **verdicts: float) -> Any:
    allowed, label, _ = plan.TAMPER_EXPECT[mode]
    counts = dict.fromkeys(("right", "wrong", "error", "hang", "aborted"), 0)
    outcomes = {"completions": dict(counts, right=sent // 2)}
    outcomes["chat"] = dict(counts, right=sent - sent // 2)
    v = verdicts or {allowed[0]: float(sent)}
    reasons = {label: float(sent)} if label else {}
    return plan.TamperPhase(outcomes, v, reasons, sent, int(v.get("mismatch", 0)))


LOG = (
    "WARNING KV checksums not verified: the producer sent no checksums.\n"
    "WARNING KV checksums not verified: the producer's checksums are invalid.\n"
)


def test_judge_tamper() -> None:
    """Bug caught: a verified load under a tampered mode passing, an HTTP 500
    counted as an answer, an unverified load without its reason (metric or
    log line) passing, or an HTTP status the checksums-off consumer did not
    give passing (R95: fail-closed + recompute answers as without checksums)."""
    phases = {m: _phase(m) for m in plan.TAMPER_EXPECT}
    same = {"on": [200] * 4, "off": [200] * 4}
    ok = plan.judge_tamper(phases, LOG, same)
    assert ok.passed, ok.checks
    verified = dict(phases, drop=_phase("drop", verified=1.0, unverified=4.0))
    assert not plan.judge_tamper(verified, LOG, same).passed
    swapped = dict(phases, other=_phase("other", verified=4.0))
    assert not plan.judge_tamper(swapped, LOG, same).passed
    error = _phase("garbage")
    error.outcomes["chat"].update(right=1, error=1)
    assert not plan.judge_tamper(dict(phases, garbage=error), LOG, same).passed
    no_reason = _phase("truncate")
    no_reason.reasons = {"no_checksums": 4.0}
    assert not plan.judge_tamper(dict(phases, truncate=no_reason), LOG, same).passed
    assert not plan.judge_tamper(phases, LOG.splitlines()[0], same).passed
    http_500 = {"on": [200, 200, 200, 500], "off": [200] * 4}
    assert not plan.judge_tamper(phases, LOG, http_500).passed
    assert not plan.judge_tamper(phases, LOG, {"on": [], "off": []}).passed


@pytest.mark.kv_checksum_capability("metrics")
def test_reason_texts_are_the_package_and_guide_ones() -> None:
    """Bug caught: the driver looking for reason texts or labels the package
    does not log (every GPU tamper run failing, or a renamed reason unseen)."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.prom_metrics import (
        REASON_LABELS,
    )

    guide = (EXAMPLES.parents[1] / "docs/features/kv_checksum.md").read_text()
    for _, label, text in plan.TAMPER_EXPECT.values():
        if text is not None:
            assert REASON_LABELS[text] == label
            assert f"| {text} | `{label}` |" in guide


def test_labelled_counts() -> None:
    """Bug caught: another counter's samples summed in, or a label set read once."""
    name = "vllm:kv_checksum_unverified_loads_total"
    page = (
        f'{name}{{engine="0",reason="no_checksums"}} 2.0\n'
        f'{name}{{engine="1",reason="no_checksums"}} 1.0\n'
        'vllm:kv_checksum_unverified_loads_created{reason="no_checksums"} 1.7e9\n'
    )
    assert plan.labelled_counts(page, name, "reason") == {"no_checksums": 3.0}


def _ports(topology: Any) -> list[int]:
    ports = [p for s in topology.servers for p in (s.port, s.side_port)]
    ports += [p for r in topology.routers for p in (r.port, r.prom_port)]
    return ports + [p.port for p in topology.proxies]


def _free_offset(topology: Any) -> int:
    for offset in range(30000, 36000, 97):
        try:
            for port in _ports(topology):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return offset
        except OSError:
            continue
    raise RuntimeError("no free port range")


def test_all_scenarios_one_topology() -> None:
    """Bug caught: tamper's proxy, routers or checksums-off consumer sharing a
    port (or a router's prometheus port) with another scenario's server."""
    names = "producer_kill,client_abort,consumer_restart,lease_expiry,tamper"
    topology = plan.plan_topology(names.split(","), 20, 2, 0.01)
    assert len(set(_ports(topology))) == len(_ports(topology))
    assert topology.server("consumer_off").checksums is False
    tamper = {r.name: r for r in topology.routers}["router_tamper"]
    assert (tamper.producer, tamper.consumer) == ("proxy", "consumer")
    config = plan.kv_transfer_config(topology.server("consumer_off"), "nixl-pull")
    assert "enable_kv_checksum" not in config["kv_connector_extra_config"]


def test_tamper_dry_run(tmp_path: Path) -> None:
    """The tamper scenario end to end on CPU: fake producer and consumers,
    the real proxy, the fake server's router; its summary must pass, with every
    mode's requests rewritten by the proxy.

    Bug caught: the proxy failing health checks or streams (the router never
    starts), the driver's chat requests answered as errors, or the scenario
    judging the wrong consumer's metrics."""
    fake = f"{chaos.sys.executable} {FAKE}"
    argv = ["--out", str(tmp_path), "--scenarios", "tamper", "--no-build"]
    argv += ["--serve-cmd", fake, "--router-cmd", f"{fake} router"]
    argv += ["--num-prompts", "4", "--tamper-requests", "2"]
    argv += ["--tamper-concurrent", "2", "--startup-timeout", "120"]
    offset = _free_offset(plan.plan_topology(["tamper"], 20, 2, 0.01))
    assert chaos.main([*argv, "--port-offset", str(offset)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    entry = summary["scenarios"]["tamper"]
    assert entry["pass"], entry
    for mode in plan.TAMPER_EXPECT:
        assert entry["counts"][mode]["rewritten"] == 8
    assert entry["counts"]["statuses"]["off"] == [200] * 8
