# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-hit cost benchmark (issue 31 item 4: what R140's verification of
local prefix-cache hits costs in `vllm bench serve`): its verdict rule on
hand-computed rounds, its engine configs, and a whole run against fake servers
and a fake `vllm bench serve` on CPU."""

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

ROOT = Path(__file__).resolve().parents[4]
PATH = ROOT / "benchmarks/benchmark_kv_checksum_prefix_hits.py"
FAKE = Path(__file__).resolve().parent / "kv_checksum_fake_server.py"


bench = load_script("bench_prefix_hits", PATH)


def _rounds(
    rps: list[float], ttft: list[float], hits: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """Rounds in ABBA order with the given per-round throughput and median TTFT;
    ``hits`` are the prefix-hit deltas of the on rounds, in order."""
    modes = ["off", "on", "on", "off", "off", "on"][: len(rps)]
    on_hits = iter(hits)
    return [
        {
            "round": k,
            "launch": 0,
            "mode": mode,
            "results": {
                "w": {
                    "request_throughput": rps[k],
                    "median_ttft_ms": ttft[k],
                    "median_tpot_ms": 5.0,
                    "failed": 0,
                }
            },
            "prefix_hits": {"w": next(on_hits) if mode == "on" else {}},
        }
        for k, mode in enumerate(modes)
    ]


HITS = [{"verified": 20.0, "unverified": 1.0}, {"verified": 25.0}, {"verified": 30.0}]


def test_rounds_alternate_abba() -> None:
    """Bug caught: plain alternation (off, on, off, on), which puts every on
    round after an off round, so a drift over the run reads as a cost."""
    assert bench.round_modes(6) == ["off", "on", "on", "off", "off", "on"]
    assert bench.round_modes(8)[4:] == ["off", "on", "on", "off"]


def test_within_spread_passes() -> None:
    """Off 10.0 / 10.2 / 10.4 req/s (mean 10.2, spread 0.4), on 10.1 / 10.0 /
    10.3 (mean 10.1333): on/off 0.99346; off TTFT 30.0 / 31.0 / 30.5 ms (mean
    30.5, spread 1.0), on 30.6 / 31.2 / 30.9 (mean 30.9): +0.4 ms, both inside
    the spread. Hits 75 verified, 1 unverified (reported, not a failure)."""
    rps = [10.0, 10.1, 10.0, 10.2, 10.4, 10.3]
    ttft = [30.0, 30.6, 31.2, 31.0, 30.5, 30.9]
    row = bench.judge(_rounds(rps, ttft, HITS))["workloads"]["w"]
    assert row["request_throughput"]["on_over_off"] == pytest.approx(
        10.133333 / 10.2, abs=1e-5
    )
    assert row["request_throughput"]["off_spread"] == pytest.approx(0.4)
    assert row["median_ttft_ms"]["on_minus_off"] == pytest.approx(0.4)
    assert row["median_ttft_ms"]["off_spread"] == pytest.approx(1.0)
    assert row["prefix_hits_on"] == {"verified": 75.0, "unverified": 1.0}
    assert row["throughput_inside_spread"] is True
    assert row["ttft_inside_spread"] is True
    assert row["passed"] is True


def test_three_percent_throughput_drop_fails_even_inside_spread() -> None:
    """On 9.7 req/s against off 9.5 / 10.5 / 10.0 (mean 10.0, spread 1.0): on/off
    0.97 < 0.98 fails although the drop is inside the spread (bugs caught: the
    ratio taken off/on, 1.031; judging by the spread alone)."""
    rps = [9.5, 9.7, 9.7, 10.5, 10.0, 9.7]
    ttft = [30.0] * 6
    summary = bench.judge(_rounds(rps, ttft, HITS))
    row = summary["workloads"]["w"]
    assert row["request_throughput"]["on_over_off"] == pytest.approx(0.97)
    assert row["throughput_inside_spread"] is True
    assert row["throughput_ok"] is False
    assert row["passed"] is False and summary["pass"] is False


def test_two_ms_ttft_increase_fails() -> None:
    """Off median TTFT 30 ms every round, on 32 ms: +2 ms > +1 ms fails (bug
    caught: the delta taken off - on, -2 ms, which would pass)."""
    summary = bench.judge(_rounds([10.0] * 6, [30, 32, 32, 30, 30, 32], HITS))
    row = summary["workloads"]["w"]
    assert row["median_ttft_ms"]["on_minus_off"] == pytest.approx(2.0)
    assert row["ttft_ok"] is False and row["ttft_inside_spread"] is False
    assert summary["pass"] is False


def test_mismatch_or_no_verified_hit_fails() -> None:
    """Equal timings, but one mismatched hit fails; so do on rounds with no
    verified hit at all (bug caught: a run where the flag never reached the
    engine passing on timings alone)."""
    hits = [{"verified": 20.0}, {"verified": 20.0, "mismatch": 1.0}, {}]
    summary = bench.judge(_rounds([10.0] * 6, [30.0] * 6, hits))
    assert summary["workloads"]["w"]["hits_ok"] is False
    assert summary["pass"] is False
    none = [{"unverified": 20.0}, {}, {}]
    assert bench.judge(_rounds([10.0] * 6, [30.0] * 6, none))["pass"] is False
    assert bench.judge(_rounds([10.0] * 6, [30.0] * 6, HITS))["pass"] is True


def test_transfer_configs_differ_only_by_package_keys() -> None:
    """The off engine runs the same connector and vLLM policy without any of
    the package's keys; the on engine adds exactly the three (bug caught: a
    comparison of two different connectors or offload sizes)."""
    off, on = bench.transfer_config("off", 8), bench.transfer_config("on", 8)
    assert off == {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8 * 1024**3},
    }
    assert on["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 8 * 1024**3,
        "enable_kv_checksum": True,
        "kv_checksum_verify_prefix_hits": True,
        "kv_checksum_fail_closed": True,
    }
    assert {k: v for k, v in on.items() if k != "kv_connector_extra_config"} == {
        k: v for k, v in off.items() if k != "kv_connector_extra_config"
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_whole_run_against_fake_servers(tmp_path: Path) -> None:
    """Two fake engines at once, 4 ABBA rounds of the two default workloads
    (3 and 6 prompts at scale 0.02): seeds 0, 0, 1, 1 so each off/on pair
    sends the same prompts, the on engine's prefix-hit counter grows by one per
    prompt (the fake's rule) and the off engine's not at all, each bench call
    carries the shared-prefix flags, and the fixed fake timings pass."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # no model build
    fake = f"{sys.executable} {FAKE}"
    out = tmp_path / "out"
    rc = bench.main(
        ["--out", str(out), "--model", str(model), "--rounds", "4", "--scale"]
        + ["0.02", "--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
        + ["120", "--port-off", str(_free_port()), "--port-on", str(_free_port())]
    )
    record = json.loads((out / "summary.json").read_text())
    rounds = record["rounds"]
    assert [(r["mode"], r["seed"]) for r in rounds] == [
        ("off", 0),
        ("on", 0),
        ("on", 1),
        ("off", 1),
    ]
    for r in rounds:
        assert r["results"]["shared_c8"]["completed"] == 3
        assert r["results"]["shared_c32"]["completed"] == 6
        assert r["results"]["shared_c8"]["ttfts_ms"] == [20.0] * 3
        expected = {"shared_c8": 3.0, "shared_c32": 6.0}
        for name, count in expected.items():
            hits = r["prefix_hits"][name]
            if r["mode"] == "on":
                assert hits == {"mismatch": 0.0, "verified": count}
            else:
                assert hits == {}
    logs = out / "launch0"
    assert "kv_checksum_verify_prefix_hits" in (logs / "on.log").read_text()
    assert "kv_checksum" not in (logs / "off.log").read_text()
    bench_log = (logs / "round2_on_shared_c32.log").read_text()
    for flag in ("'--random-prefix-len', '2048'", "'--max-concurrency', '32'"):
        assert flag in bench_log
    assert "'--seed', '1'" in bench_log and "'--num-warmups', '0'" in bench_log
    assert record["summary"]["pass"] is True and rc == 0
