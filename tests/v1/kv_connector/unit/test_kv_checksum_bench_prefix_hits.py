# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-hit cost benchmark (issue 31 item 4: what R140's verification of
local prefix-cache hits costs in `vllm bench serve`): its verdict rule on
hand-computed rounds, its engine configs, and a whole run against fake servers
and a fake `vllm bench serve` on CPU; the same for the CPU offload tiers (issue 26
item 3: what verifying loads back from host memory, R116-R121, costs)."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

ROOT = Path(__file__).resolve().parents[4]
PATH = ROOT / "benchmarks/benchmark_kv_checksum_prefix_hits.py"
FAKE = Path(__file__).resolve().parent / "kv_checksum_fake_server.py"


bench = load_script("bench_prefix_hits", PATH)
tiers = load_script("bench_tiers", ROOT / "benchmarks/kv_checksum_bench_tiers.py")


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


def test_ttft_target_judged_at_concurrency_one_only() -> None:
    """R140 cost (issue 31 item 4): the same +2 ms rounds fail `shared_c1` (one request
    at a time) and are reported, not judged, for `shared_c32`, where queueing moves the
    median by tens of ms (bugs caught: the TTFT target dropped for every workload, or
    held at c32 where no run can resolve it)."""

    def named(rounds: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
        for r in rounds:
            r["results"] = {name: r["results"]["w"]}
            r["prefix_hits"] = {name: r["prefix_hits"]["w"]}
        return rounds

    ttft = [30, 32, 32, 30, 30, 32]
    c1 = bench.judge(named(_rounds([10.0] * 6, ttft, HITS), "shared_c1"))
    row = c1["workloads"]["shared_c1"]
    assert row["ttft_judged"] is True and row["ttft_ok"] is False
    assert c1["pass"] is False
    c32 = bench.judge(named(_rounds([10.0] * 6, ttft, HITS), "shared_c32"))
    row = c32["workloads"]["shared_c32"]
    assert row["ttft_judged"] is False and row["ttft_ok"] is True
    assert row["median_ttft_ms"]["on_minus_off"] == pytest.approx(2.0)
    assert c32["pass"] is True


def test_paired_differences_beside_the_off_spread() -> None:
    """R140 cost (issue 31 item 4): rounds off, on, on, off, off, on with seeds 0, 0,
    1, 1, 2, 2, TTFT drifting up by 10 ms per pair, on 1, 1 and 7 ms above its
    pair's off: the off spread is 20 ms, but the pairs differ by +1, +1, +7 (median
    +1, min +1, max +7; the means by +3). Bugs caught: a pair formed across
    launches (same seed, another engine pair), the ratio taken off/on, and pairs
    made up for rounds recorded without seeds."""
    rounds = _rounds([10.0, 9.0, 8.0, 8.5, 7.0, 6.3], [30, 31, 41, 40, 50, 57], HITS)
    for r, seed in zip(rounds, [0, 0, 1, 1, 2, 2]):
        r["seed"] = seed
    row = bench.judge(rounds)["workloads"]["w"]
    ttft = row["median_ttft_ms"]
    assert ttft["on_minus_off"] == pytest.approx(3.0)
    assert ttft["off_spread"] == pytest.approx(20.0)
    assert ttft["paired"]["on_minus_off"] == pytest.approx([1.0, 1.0, 7.0])
    assert ttft["paired"]["median_on_minus_off"] == pytest.approx(1.0)
    assert ttft["paired"]["min_on_minus_off"] == pytest.approx(1.0)
    assert ttft["paired"]["max_on_minus_off"] == pytest.approx(7.0)
    rps = row["request_throughput"]["paired"]
    assert rps["on_over_off"] == pytest.approx([0.9, 8.0 / 8.5, 0.9])
    assert rps["median_on_over_off"] == pytest.approx(0.9)
    rounds[1]["launch"] = 1  # its off partner is in another launch now
    pairs = bench.judge(rounds)["workloads"]["w"]["median_ttft_ms"]["paired"]
    assert pairs["on_minus_off"] == pytest.approx([1.0, 7.0])
    for r in rounds:
        del r["seed"]
    assert bench.judge(rounds)["workloads"]["w"]["median_ttft_ms"]["paired"] == {}


def _rejudge(*args: object, check: bool = True) -> "subprocess.CompletedProcess[str]":
    """`benchmarks/rejudge_kv_checksum_rounds.py ARGS`, run as a user runs it
    (`check`: it must exit 0)."""
    script = ROOT / "benchmarks/rejudge_kv_checksum_rounds.py"
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        check=check,
    )


def _write_summaries(tmp_path: Path, *records: dict[str, Any]) -> list[Path]:
    """Each record as a summary file of its own, in order: their paths."""
    paths = []
    for k, record in enumerate(records):
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(record))
    return paths


def test_rejudge_prints_pairs_of_a_recorded_summary(tmp_path: Path) -> None:
    """R140 cost (issue 31 item 4): `benchmarks/rejudge_kv_checksum_rounds.py`
    (the command of `cpu_paired_rejudge_2026-12-01f.md`) reads a recorded
    summary and prints the ratio of the means beside the median of the pairs:
    0.914 against 0.900 for the rounds of the paired test above. Bug caught: the
    script judging with another tier or dropping the seeds, so it would print
    no pairs."""
    rounds = _rounds([10.0, 9.0, 8.0, 8.5, 7.0, 6.3], [30, 31, 41, 40, 50, 57], HITS)
    for r, seed in zip(rounds, [0, 0, 1, 1, 2, 2]):
        r["seed"] = seed
    summary = tmp_path / "summary.json"
    record = {"config": {"tier": "simple-hits"}, "rounds": rounds}
    summary.write_text(json.dumps(record))
    out = _rejudge(summary).stdout
    means = (9.0 + 8.0 + 6.3) / 3 / ((10.0 + 8.5 + 7.0) / 3)
    assert f"req/s on/off of the means {means:.3f}" in out
    assert "median of 3 pairs 0.900 (0.900 .. 0.941)" in out
    assert "median of pairs +1.00 ms (+1.00 .. +7.00)" in out
    assert "95 % interval over 3 pairs (resampled): mean req/s on/off" in out


def test_rejudge_interval_brackets_the_pairs_mean_and_narrows_with_pairs() -> None:
    """R142, issue 30 (judging wide spreads): the 95 % bootstrap interval of the
    pairs' mean is the same on every call (fixed seed), lies inside the
    pairs' range and around their mean, is one point when every pair agrees,
    and narrows as the same spread of pairs grows from 4 to 64. Bugs caught:
    an unseeded draw (a record's interval changing on re-reading), the
    interval of one resample (no spread), percentiles taken over the pairs
    instead of their resampled means (as wide at 64 pairs as at 4)."""
    rejudge = load_script(
        "rejudge_rounds", ROOT / "benchmarks/rejudge_kv_checksum_rounds.py"
    )
    few = [0.8, 1.0, 0.9, 0.95]
    low, high = rejudge.bootstrap_interval(few)
    assert (low, high) == rejudge.bootstrap_interval(few)
    assert 0.8 <= low < sum(few) / 4 < high <= 1.0
    assert rejudge.bootstrap_interval([0.9] * 6) == (0.9, 0.9)
    many_low, many_high = rejudge.bootstrap_interval(few * 16)
    assert many_low < sum(few) / 4 < many_high
    assert many_high - many_low < (high - low) / 2


def test_rejudge_pools_runs_per_workload(tmp_path: Path) -> None:
    """R140 cost (issue 31 item 4): `--pool` judges the rounds of several recorded
    runs as one, per workload. Run 1 ran workloads w and x, run 2 only w, both in
    launch 0 with seeds 0: w has 2 + 1 pairs, x the 2 of run 1 and no failures.
    Bugs caught: the runs' launches not kept apart (run 2's seed-0 pair joined to
    run 1's, 2 pairs), a run without x counting its rounds as x's failures, and
    an A/A control (nothing verified) pooled with real runs."""

    def run(rps: list[float], ttft: list[float], with_x: bool) -> dict[str, Any]:
        rounds = _rounds(rps, ttft, HITS)
        for r, seed in zip(rounds, [0, 0, 1, 1]):
            r["seed"] = seed
            if with_x:
                r["results"]["x"] = dict(r["results"]["w"])
                r["prefix_hits"]["x"] = r["prefix_hits"]["w"]
        return {"config": {"tier": "simple-hits"}, "rounds": rounds}

    paths = _write_summaries(
        tmp_path,
        run([10.0, 9.0, 8.0, 8.5], [30, 31, 41, 40], True),
        run([6.0, 6.6], [50, 48], False),
    )
    out = _rejudge("--pool", *paths).stdout
    w_means = (9.0 + 8.0 + 6.6) / 3 / ((10.0 + 8.5 + 6.0) / 3)
    assert f"w: req/s on/off of the means {w_means:.3f}" in out
    assert "median of 3 pairs 0.941 (0.900 .. 1.100)" in out
    x_means = (9.0 + 8.0) / 2 / ((10.0 + 8.5) / 2)
    assert f"x: req/s on/off of the means {x_means:.3f}" in out
    assert "median of 2 pairs 0.921 (0.900 .. 0.941)" in out
    assert out.count("; failed 0;") == 2
    control = tmp_path / "control.json"
    control.write_text(
        json.dumps(
            {
                **run([6.0, 6.1], [50, 50], False),
                "config": {"tier": "simple-hits", "control": True},
            }
        )
    )
    mixed = _rejudge("--pool", *paths, control, check=False)
    assert mixed.returncode != 0 and "judged differently" in mixed.stderr


def _serve_summary(rps: list[float], control: bool = False) -> dict[str, Any]:
    """A serve benchmark summary of launch records in pair order (off, on, on,
    off, ...), TTFT 10 x req/s, every "on" launch with 4 verified loads."""
    launches = []
    for k, value in enumerate(rps):
        mode = "off" if k % 4 in (0, 3) else "on"
        launches.append(
            {
                "mode": mode,
                "results": {
                    "w": {
                        "request_throughput": value,
                        "median_ttft_ms": 10 * value,
                        "median_tpot_ms": 3.0,
                        "failed": 0,
                    }
                },
                "verdicts": {"verified": 4.0} if mode == "on" and not control else {},
                "launch": 0,
                "slot": "a",
            }
        )
    return {"config": {"control": control}, "launches": launches}


def test_rejudge_pools_serve_summaries(tmp_path: Path) -> None:
    """R142 (tiny-model cost over interleaved rounds), issue 30 (the NIXL pull
    cost judged over several runs): `--pool` reads
    `benchmark_kv_checksum_serve.py` summaries too, pairs within each file.
    Run 1's pairs are (10, 9) and (8.5, 8), run 2's (6, 6.6): 3 pairs, median
    ratio 0.941. Bugs caught: only the first file pooled (2 pairs), a file
    with half a pair accepted (a pair across two runs) or, with
    `--drop-half-pair`, its whole pairs dropped too, an A/A control
    pooled with real runs, and a run of one pair (no off spread) crashing
    the pair line."""
    paths = _write_summaries(
        tmp_path, _serve_summary([10.0, 9.0, 8.0, 8.5]), _serve_summary([6.0, 6.6])
    )
    out = _rejudge("--pool", *paths).stdout
    means = (9.0 + 8.0 + 6.6) / 3 / ((10.0 + 8.5 + 6.0) / 3)
    assert f"w: req/s on/off of the means {means:.3f}" in out
    assert "median of 3 pairs 0.941 (0.900 .. 1.100)" in out
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(_serve_summary([6.0, 6.6, 7.0])))
    refused = _rejudge("--pool", paths[0], odd, check=False)
    assert refused.returncode != 0 and "odd number" in refused.stderr
    # A run cut short: its half pair left out on request, the rest pooled.
    dropped = _rejudge("--pool", "--drop-half-pair", paths[0], odd)
    assert "median of 3 pairs 0.941 (0.900 .. 1.100)" in dropped.stdout
    assert "last record left out" in dropped.stderr
    control = tmp_path / "control.json"
    control.write_text(json.dumps(_serve_summary([6.0, 6.1], control=True)))
    mixed = _rejudge("--pool", *paths, control, check=False)
    assert mixed.returncode != 0 and "A/A control" in mixed.stderr
    # One pair alone has no off spread: judged, not a crash.
    single = _rejudge(paths[1]).stdout
    assert "median of 1 pairs 1.100" in single and "off spread n/a" in single


def test_server_times_from_vllm_histograms() -> None:
    """R140 cost runs: the engine's side of a round's TTFT from vLLM's histogram lines
    (sum and count of each, labels and buckets ignored): means in ms of the deltas. Bugs
    caught: bucket lines summed into the sum, a mean taken sum/count of another
    histogram, or seconds reported as ms."""
    page = "\n".join(
        [
            'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 7.0',
            'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.3',
            'vllm:time_to_first_token_seconds_count{model_name="m"} 10.0',
            'vllm:request_prefill_time_seconds_sum{model_name="m"} 0.12',
            'vllm:request_prefill_time_seconds_count{model_name="m"} 10.0',
            'vllm:request_queue_time_seconds_sum{model_name="m"} 0.0',
            'vllm:request_queue_time_seconds_count{model_name="m"} 10.0',
            'vllm:e2e_request_latency_seconds_sum{model_name="m"} 9.0',
        ]
    )
    after = bench.verdict_counts(page, bench.SERVER_TIMES)
    assert set(after) == {
        f"{n}_seconds_{k}"
        for n in ("time_to_first_token", "request_prefill_time", "request_queue_time")
        for k in ("sum", "count")
    }
    before = {"time_to_first_token_seconds_sum": 0.1}
    before["time_to_first_token_seconds_count"] = 6.0
    means = bench.histogram_means_ms(bench.counter_delta(before, after))
    assert means["time_to_first_token"] == pytest.approx(50.0)  # 0.2 s / 4
    assert means["request_prefill_time"] == pytest.approx(12.0)
    assert means["request_queue_time"] == pytest.approx(0.0)
    assert bench.histogram_means_ms({}) == {}


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


def test_control_run_starts_both_slots_off(tmp_path: Path) -> None:
    """R140, R142 (measuring their cost): --control (A/A): the "on" slot starts
    without any package key, no hit is required, and the record says it was a
    control. Bugs caught: the control's "on" slot still verifying hits (then it
    measures checksums, not the slots), or its verdict failing for want of verified
    hits."""
    assert bench.configured_mode("on", True) == "off"
    assert bench.configured_mode("on", False) == "on"
    assert bench.judge(_rounds([10.0] * 6, [30.0] * 6, [{}, {}, {}]), control=True)[
        "pass"
    ]
    model, fake, out = _fake_setup(tmp_path)
    rc = bench.main(
        ["--out", str(out), "--model", str(model), "--rounds", "2", "--scale"]
        + ["0.02", "--workloads", "shared_c8", "--control"]
        + ["--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
        + ["120", "--port-off", str(_free_port()), "--port-on", str(_free_port())]
    )
    record = json.loads((out / "summary.json").read_text())
    assert "kv_checksum" not in (out / "launch0" / "on.log").read_text()
    configs = record["config"]["transfer_config"]
    assert configs["on"] == configs["off"] == bench.transfer_config("off", 8)
    assert record["config"]["control"] is True and record["summary"]["control"]
    assert [r["prefix_hits"]["shared_c8"] for r in record["rounds"]] == [{}, {}]
    assert rc == 0


def test_swapped_slots_separate_effect_from_slot_bias() -> None:
    """R142 (a fair on/off cost): launch 0 runs "on" in slot b: on - off =
    +3 req/s; launch 1 runs it in slot a: on - off = -1. So the checksum
    effect is +1 and slot b is +2 over slot a, while the plain means over
    both launches give the effect too.
    Bugs caught: the bias's sign flipped (b - a read as a - b), the launches
    pooled into one placement (no bias estimate), or odd launches left in
    place (a bias then reads as a cost)."""
    assert bench.launch_slots(0, True) == {"off": "a", "on": "b"}
    assert list(bench.launch_slots(1, True).items()) == [("on", "a"), ("off", "b")]
    assert bench.launch_slots(1, False) == {"off": "a", "on": "b"}
    rounds = []
    for launch, (off, on) in enumerate([(10.0, 13.0), (11.0, 10.0)]):
        slots = bench.launch_slots(launch, True)
        for k, mode in enumerate(["off", "on", "on", "off"]):
            rounds.append(
                {
                    "round": launch * 4 + k,
                    "launch": launch,
                    "mode": mode,
                    "seed": launch * 2 + k // 2,
                    "slot": slots[mode],
                    "results": {
                        "w": {"request_throughput": on if mode == "on" else off}
                    },
                }
            )
    bias = bench.slot_bias(rounds, "w", "request_throughput")
    assert bias == {
        "on_minus_off_on_in_b": 3.0,
        "on_minus_off_on_in_a": -1.0,
        "effect": 1.0,
        "slot_b_minus_a": 2.0,
    }
    values = bench.mode_values(rounds, "w", "request_throughput")
    assert sum(values["on"]) / 4 - sum(values["off"]) / 4 == pytest.approx(1.0)
    assert bench.slot_bias(rounds[:4], "w", "request_throughput") == {}


def test_swap_slots_run_moves_on_to_the_first_port(tmp_path: Path) -> None:
    """R142: --swap-slots --launches 2 against fake servers: launch 1's "on" engine
    serves on --port-off and starts first, every round records its slot, and
    the verdict carries the slot bias (bug caught: the swap naming slots in the
    record while the engines kept their ports, so nothing was swapped)."""
    model, fake, out = _fake_setup(tmp_path)
    port_a, port_b = _free_port(), _free_port()
    rc = bench.main(
        ["--out", str(out), "--model", str(model), "--rounds", "2", "--scale"]
        + ["0.02", "--workloads", "shared_c8", "--launches", "2", "--swap-slots"]
        + ["--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
        + ["120", "--port-off", str(port_a), "--port-on", str(port_b)]
    )
    record = json.loads((out / "summary.json").read_text())
    assert [(r["launch"], r["mode"], r["slot"]) for r in record["rounds"]] == [
        (0, "off", "a"),
        (0, "on", "b"),
        (1, "off", "b"),
        (1, "on", "a"),
    ]
    assert record["config"]["slots"]["launch1"] == {"on": "a", "off": "b"}
    on_log = (out / "launch1" / "round3_on_shared_c8.log").read_text()
    assert f"'http://127.0.0.1:{port_a}'" in on_log
    bias = record["summary"]["workloads"]["shared_c8"]["request_throughput"]
    assert bias["slot_bias"]["effect"] == pytest.approx(0.0)
    assert rc == 0


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


def _fake_setup(tmp_path: Path) -> tuple[Path, str, Path]:
    """A model folder the driver does not build, the fake server command and
    the run's output folder."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # no model build
    return model, f"{sys.executable} {FAKE}", tmp_path / "out"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_whole_run_against_fake_servers(tmp_path: Path) -> None:
    """Two fake engines at once, 4 ABBA rounds of the two shared-prefix
    workloads (3 and 6 prompts at scale 0.02): seeds 0, 0, 1, 1 so each off/on pair
    sends the same prompts, the on engine's prefix-hit counter grows by one per
    prompt (the fake's rule) and the off engine's not at all, each bench call
    carries the shared-prefix flags, and the fixed fake timings pass."""
    model, fake, out = _fake_setup(tmp_path)
    rc = bench.main(
        ["--out", str(out), "--model", str(model), "--rounds", "4", "--scale"]
        + ["0.02", "--workloads", "shared_c8,shared_c32"]
        + ["--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
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


def test_bench_batch_reads_counters_between_runs(tmp_path: Path) -> None:
    """R140 cost runs: --bench-batch against two fake engines: every bench run of the
    launch (warm-ups and rounds) goes through vLLM's real bench-serve `main` in one
    batch process, and each run's prefix-hit delta is its own, read after the run ended
    (bugs caught: counters read before the batch process finished a run, so deltas of 0
    or of the next run; the flag ignored and the CLI run)."""
    fake = f"{sys.executable} {FAKE}"
    out = tmp_path / "out"
    bench.main(
        ["--out", str(out), "--model", str(tmp_path / "model"), "--shape", "tiny"]
        + ["--rounds", "2", "--scale", "0.1", "--bench-batch"]
        + ["--workloads", "shared_c1,shared_c32", "--serve-cmd", fake]
        + ["--bench-cmd", "/nonexistent/vllm", "--startup-timeout", "120"]
        + ["--port-off", str(_free_port()), "--port-on", str(_free_port())]
    )
    record = json.loads((out / "summary.json").read_text())
    off, on = record["rounds"]
    prompts = {"shared_c1": 5, "shared_c32": 32}
    for name, count in prompts.items():
        assert off["results"][name]["completed"] == count
        assert on["results"][name]["completed"] == count
        assert off["prefix_hits"][name] == {}
        # vLLM's bench sends its initial test prompt first: one completion more.
        verified = count + 1
        assert on["prefix_hits"][name] == {"mismatch": 0.0, "verified": verified}
    for name in ("round0_off_shared_c1", "round1_on_shared_c32", "warmup0_on"):
        text = (out / "launch0" / f"{name}.log").read_text()
        assert "[bench_batch] vllm bench serve" in text and "fake bench" not in text


PACKAGE_KEYS = {"enable_kv_checksum", "kv_checksum_fail_closed"}


def test_simple_stores_tier_is_simple_hits_without_the_hit_flag() -> None:
    """R140, R142 (measuring their cost): the bisecting tier: the same connector,
    CPU size, workloads and GPU cache as simple-hits, checksums on without
    `kv_checksum_verify_prefix_hits`, and no hit required by its verdict. Bugs
    caught: the hit flag left in (then it bisects nothing), the tier counted as an
    offload tier (a small GPU cache, so other workloads), or its verdict failing for
    want of verified hits."""
    hits, stores = (
        tiers.transfer_config("on", 8, t) for t in ("simple-hits", "simple-stores")
    )
    assert _without(hits, {"kv_checksum_verify_prefix_hits"}) == stores
    assert "kv_checksum_verify_prefix_hits" in hits["kv_connector_extra_config"]
    assert tiers.transfer_config("off", 8, "simple-stores") == tiers.transfer_config(
        "off", 8, "simple-hits"
    )
    assert "simple-stores" not in tiers.OFFLOAD_TIERS
    assert tiers.TIER_DEFAULTS["simple-stores"] == tiers.TIER_DEFAULTS["simple-hits"]
    no_hits = _rounds([10.0] * 6, [30.0] * 6, [{}, {}, {}])
    assert bench.judge(no_hits, "simple-stores")["pass"]
    assert not bench.judge(no_hits, "simple-hits")["pass"]


def _without(config: Any, keys: set[str]) -> Any:
    """``config`` with ``keys`` removed at every level."""
    if isinstance(config, dict):
        return {k: _without(v, keys) for k, v in config.items() if k not in keys}
    if isinstance(config, list):
        return [_without(v, keys) for v in config]
    return config


@pytest.mark.parametrize("tier", ["offloading", "multi", "simple-offload"])
def test_offload_tier_configs_differ_only_by_package_keys(tier: str) -> None:
    """Issue 26 item 3: off and on run the same connectors, CPU size and vLLM
    policy; on adds exactly enable_kv_checksum and kv_checksum_fail_closed, in
    the extra config the guide names (OffloadingConnector's own; the
    MultiConnector's, not its child's). Bugs caught: the prefix-hit flag leaking
    into the offload tiers, the keys put in a MultiConnector child, an on engine
    with another offload size than the off one."""
    off, on = (
        bench.transfer_config("off", 16, tier),
        bench.transfer_config("on", 16, tier),
    )
    assert _without(on, PACKAGE_KEYS) == off
    assert "kv_checksum" not in json.dumps(off)
    assert off["kv_load_failure_policy"] == "recompute"
    extra = on["kv_connector_extra_config"]
    assert {k for k in extra if "kv_checksum" in k} == PACKAGE_KEYS
    assert all(extra[k] is True for k in PACKAGE_KEYS)
    host = {"cpu_bytes_to_use": 16 * 1024**3}
    if tier != "multi":
        connector = "OffloadingConnector"
        if tier == "simple-offload":
            connector = "SimpleCPUOffloadConnector"
        assert on["kv_connector"] == connector
        assert extra == {**host, **dict.fromkeys(PACKAGE_KEYS, True)}
    else:
        assert on["kv_connector"] == "MultiConnector"
        assert extra["connectors"] == [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": host,
            },
        ]


def test_offload_gpu_cache_keeps_two_prefixes_only() -> None:
    """The 8B shape's KV is 36 x 8 x 128 x 2 x 2 = 147,456 bytes a token; the
    offload tiers' GPU cache holds host16_c8's 8 running requests (2,336 tokens,
    146 blocks of 16 + 2 spare each: 18,944 tokens) and two 2,048-token prefixes:
    23,040 tokens = 3,397,386,240 bytes, far below 16 prefixes, so most reuses load
    from host (bug caught: the 20 GiB default, which keeps every prefix on the GPU
    and never loads from host)."""
    dims = bench.SHAPES["8b"]
    assert tiers.kv_bytes_per_token(dims) == 147_456
    host16 = [w for w in bench.WORKLOADS if w.name == "host16_c8"]
    cache = tiers.kv_cache_bytes("offloading", None, dims, host16, 4096)
    assert cache == 3_397_386_240
    assert tiers.kv_cache_bytes("multi", None, dims, host16, 4096) == cache
    assert tiers.kv_cache_bytes("simple-hits", None, dims, host16, 4096) == 20 << 30
    assert tiers.kv_cache_bytes("offloading", 0.5, dims, host16, 4096) == 1 << 29
    # The CPU tier (16 GiB by default) holds all 16 prefixes, 4.5 GiB.
    assert tiers.TIER_DEFAULTS["offloading"][2] << 30 > 16 * 2048 * 147_456


def _host_rounds(
    rps: list[float], host: list[float], verdicts: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """ABBA rounds of an offload tier: per-round throughput and host loads,
    the on rounds' load verdicts in order; no prefix hits, TTFT +2 ms on."""
    rounds = _rounds(rps, [30.0, 32.0, 32.0, 30.0, 30.0, 32.0][: len(rps)], [{}] * 3)
    on_verdicts = iter(verdicts)
    for r, loads in zip(rounds, host):
        r["prefix_hits"] = {"w": {}}
        r["host_loads"] = {"w": {"size_count": loads, "bytes_total": loads * 2**28}}
        r["load_verdicts"] = {"w": next(on_verdicts) if r["mode"] == "on" else {}}
    return rounds


LOADS = [{"verified": 90.0}, {"verified": 95.0, "unverified": 1.0}, {"verified": 92.0}]


def test_offload_verdict_throughput_and_host_loads() -> None:
    """An offload tier passes on throughput and verified host loads (no
    prefix-hit counter there, TTFT reported only); it fails when either engine
    made no host load (the prefixes stayed on the GPU: nothing measured), when
    on/off < 0.98, or on one host mismatch (bugs caught: judging the offload
    tiers by the prefix-hit counter they do not have; host loads checked on the
    on engine only; a mismatch ignored)."""
    rps = [10.0, 9.9, 9.9, 10.0, 10.0, 9.9]
    host = [80.0, 90.0, 95.0, 85.0, 82.0, 92.0]
    summary = bench.judge(_host_rounds(rps, host, LOADS), "offloading")
    row = summary["workloads"]["w"]
    assert row["host_loads"]["off"]["size_count"] == 247.0
    assert row["host_loads"]["on"] == {
        "size_count": 277.0,
        "bytes_total": 277.0 * 2**28,
        "verified": 277.0,
        "unverified": 1.0,
    }
    assert row["median_ttft_ms"]["on_minus_off"] == pytest.approx(2.0)
    assert summary["pass"] is True
    no_off_loads = [
        0.0 if m == "off" else n for m, n in zip(bench.round_modes(6), host)
    ]
    assert bench.judge(_host_rounds(rps, no_off_loads, LOADS), "multi")["pass"] is False
    no_loads = [0.0] * 6
    assert bench.judge(_host_rounds(rps, no_loads, LOADS), "multi")["pass"] is False
    slow = [10.0, 9.7, 9.7, 10.0, 10.0, 9.7]
    assert bench.judge(_host_rounds(slow, host, LOADS), "offloading")["pass"] is False
    bad = [{"verified": 90.0}, {"verified": 94.0, "mismatch": 1.0}, {"verified": 9}]
    assert bench.judge(_host_rounds(rps, host, bad), "offloading")["pass"] is False
    unchecked = [{"unverified": 90.0}, {}, {}]
    assert bench.judge(_host_rounds(rps, host, unchecked), "multi")["pass"] is False


def test_simple_offload_host_loads_count_by_blocks() -> None:
    """R142 (measuring its cost), issue 30 item 3: SimpleCPUOffloadConnector
    counts host loads as blocks (`vllm:simple_kv_offload_load_blocks_total`),
    not OffloadingConnector's histogram; a /metrics page of either is read,
    and the verdict needs loads on both engines by either counter (bugs
    caught: the simple tier judged by a counter it never has, so it never
    passes; its counter not parsed)."""
    page = (
        'vllm:simple_kv_offload_load_blocks_total{engine="0",model_name="m"} 12.0\n'
        'vllm:kv_offload_load_size_count{engine="0"} 3.0\n'
        'vllm:kv_offload_load_bytes_total{engine="0"} 1024.0\n'
        'vllm:simple_kv_offload_used_blocks{engine="0"} 7.0\n'
    )
    assert bench.verdict_counts(page, tiers.HOST_LOADS) == {
        "blocks_total": 12.0,
        "size_count": 3.0,
        "bytes_total": 1024.0,
    }
    rps = [10.0, 9.9, 9.9, 10.0, 10.0, 9.9]
    rounds = _host_rounds(rps, [8.0] * 6, LOADS)
    for r in rounds:
        r["host_loads"]["w"] = {"blocks_total": 8.0}
    assert bench.judge(rounds, "simple-offload")["pass"] is True
    for r in rounds:
        if r["mode"] == "off":
            r["host_loads"]["w"] = {"blocks_total": 0.0}
    assert bench.judge(rounds, "simple-offload")["pass"] is False


def test_lmcache_tier_differs_only_by_package_keys() -> None:
    """Issue 78 item 3 (R147's cost): off and on run LMCacheConnectorV1 with the
    same LMCache environment (local CPU backend of the tier's size, 256-token
    chunks, no usage reporting) and vLLM policy; on adds exactly
    enable_kv_checksum, kv_checksum_verify_external_loads and
    kv_checksum_fail_closed; its loads are judged by vLLM's external-hit
    counter and the package's external-load verdicts. Bugs caught: the
    external-load flag missing (then nothing LMCache loads is checked and the
    cost is not measured), LMCache's size differing between the engines, its
    verdicts read from the connector-load counter it never grows."""
    off, on = (
        bench.transfer_config("off", 16, "lmcache"),
        bench.transfer_config("on", 16, "lmcache"),
    )
    keys = PACKAGE_KEYS | {"kv_checksum_verify_external_loads"}
    assert _without(on, keys) == off
    assert off == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
    }
    assert on["kv_connector_extra_config"] == dict.fromkeys(keys, True)
    assert tiers.tier_env("lmcache", 16) == {
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "16",
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "0",
    }
    assert tiers.tier_env("offloading", 16) == {}
    assert "lmcache" in tiers.OFFLOAD_TIERS
    page = (
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 512.0\n'
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 9.0\n'
        'vllm:kv_checksum_loads_total{engine="0",verdict="verified"} 7.0\n'
        'vllm:kv_checksum_external_loads_total{engine="0",verdict="verified"} 2.0\n'
        'vllm:kv_checksum_external_loads_total{engine="0",verdict="no_entry"} 1.0\n'
    )
    assert bench.verdict_counts(page, tiers.HOST_LOADS) == {"hits_total": 512.0}
    pattern = tiers.load_verdict_pattern("lmcache")
    assert bench.verdict_counts(page, pattern) == {"verified": 2.0, "no_entry": 1.0}
    pattern = tiers.load_verdict_pattern("offloading")
    assert bench.verdict_counts(page, pattern) == {"verified": 7.0}


@pytest.mark.parametrize("tier", ["offloading", "multi", "simple-offload", "lmcache"])
def test_offload_tier_run_against_fake_servers(tmp_path: Path, tier: str) -> None:
    """`--tier` with its defaults (4 ABBA rounds of host16_c8, 16 prompts at
    scale 0.02): the engines get the tier's config and the small GPU cache, the
    bench gets the prefix_repetition flags, each completion of the fake is one
    host load on both engines and one verified load on the on engine, and the
    run passes (bugs caught: the workload flags or the cache size not reaching
    the commands; host loads read from the wrong counter)."""
    model, fake, out = _fake_setup(tmp_path)
    rc = bench.main(
        ["--out", str(out), "--model", str(model), "--tier", tier, "--scale"]
        + ["0.02", "--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
        + ["120", "--port-off", str(_free_port()), "--port-on", str(_free_port())]
    )
    record = json.loads((out / "summary.json").read_text())
    assert [r["mode"] for r in record["rounds"]] == ["off", "on", "on", "off"]
    for r in record["rounds"]:
        assert r["results"]["host16_c8"]["completed"] == 16
        loaded = {"simple-offload": "blocks_total", "lmcache": "hits_total"}
        loads = r["host_loads"]["host16_c8"][loaded.get(tier, "size_count")]
        assert loads == (16.0 * 256 if tier == "lmcache" else 16.0)
        verdicts = r["load_verdicts"]["host16_c8"]
        on = r["mode"] == "on"
        expected = {"mismatch": 0.0, "verified": 16.0}
        if tier != "lmcache":
            expected["unverified"] = 0.0
        assert verdicts == (expected if on else {})
    logs = out / "launch0"
    off_log, on_log = (logs / "off.log").read_text(), (logs / "on.log").read_text()
    connector = {
        "simple-offload": "SimpleCPUOffloadConnector",
        "lmcache": "LMCacheConnectorV1",
    }.get(tier, "OffloadingConnector")
    for log_text in (off_log, on_log):
        assert "'--kv-cache-memory-bytes', '3397386240'" in log_text
        assert connector in log_text
    assert "kv_checksum_fail_closed" in on_log and "kv_checksum" not in off_log
    assert "verify_prefix_hits" not in on_log
    bench_log = (logs / "round3_off_host16_c8.log").read_text()
    for flag in (
        "'--dataset-name', 'prefix_repetition'",
        "'--prefix-repetition-num-prefixes', '16'",
        "'--prefix-repetition-prefix-len', '2048'",
        "'--max-concurrency', '8'",
        "'--num-prompts', '16'",
        "'--seed', '1'",
    ):
        assert flag in bench_log
    assert record["config"]["tier"] == tier
    assert record["summary"]["pass"] is True and rc == 0


def test_trace_summary_totals_tops_and_host_waits() -> None:
    """Trace events sum by category and name, rank by total time, and the
    synchronize calls show as host waits (bug caught: a sync hidden among the
    runtime calls, or counts summed as times)."""
    events = [
        {"cat": "kernel", "name": "_kv_checksum_kernel", "dur": 100.0},
        {"cat": "kernel", "name": "gemm", "dur": 300.0},
        {"cat": "kernel", "name": "_kv_checksum_kernel", "dur": 50.0},
        {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "dur": 4000.0},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 5.0},
        {"cat": "kernel", "name": "no duration"},
    ]
    summary = bench.summarize_trace_events(events, top=1)
    assert summary["kernel"] == {
        "total_us": 450.0,
        "events": 3,
        "top": [["gemm", 300.0, 1]],
    }
    assert summary["host_waits"] == {"cudaEventSynchronize": [4000.0, 1]}
    assert summary["cuda_runtime"]["total_us"] == 4005.0
    assert "python_function" not in summary  # no stacks: no empty category
    # The package's kernel is watched though top=1 ranks it out.
    assert summary["watched"] == {"kernel/_kv_checksum_kernel": [150.0, 2]}


def test_trace_summary_lists_every_step_phase() -> None:
    """R142 (where host time goes): vLLM's step phases (user annotations) are all
    listed, whatever `top`, and watched runtime calls are summed apart (bug caught:
    a pinned host allocation per step hidden below the top of the runtime calls)."""
    events = [
        {"cat": "user_annotation", "name": f"gpu_model_runner: phase {i}", "dur": i}
        for i in range(1, 21)
    ] + [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 500.0},
        {"cat": "cuda_runtime", "name": "cudaHostAlloc", "dur": 30.0},
        {"cat": "cuda_runtime", "name": "cudaHostAlloc", "dur": 20.0},
    ]
    summary = bench.summarize_trace_events(events, top=1)
    assert len(summary["user_annotation"]["top"]) == 20
    assert summary["user_annotation"]["total_us"] == 210.0
    assert summary["watched"] == {"cuda_runtime/cudaHostAlloc": [50.0, 2]}


def test_trace_summary_ranks_python_functions_deeper() -> None:
    """R142 (where host time goes): a trace with Python stacks lists more
    functions than `top`, and the package's own functions are summed apart
    (bug caught: the package's step work ranked out of a 60-deep list by
    vLLM's own functions, or stacks dropped as an unknown category)."""
    events = [
        {"cat": "python_function", "name": f"vllm/v1/x.py({i}): f{i}", "dur": 100 + i}
        for i in range(70)
    ] + [
        {
            "cat": "python_function",
            "name": "kv_checksum/engine/worker.py(9): g",
            "dur": 3,
        },
        {
            "cat": "python_function",
            "name": "kv_checksum/engine/worker.py(9): g",
            "dur": 4,
        },
    ]
    summary = bench.summarize_trace_events(events, top=1)
    functions = summary["python_function"]
    assert functions["events"] == 72 and len(functions["top"]) == 60
    assert functions["top"][0] == ["vllm/v1/x.py(69): f69", 169.0, 1]
    assert summary["watched"] == {
        "python_function/kv_checksum/engine/worker.py(9): g": [7.0, 2]
    }


def test_python_self_time_excludes_the_functions_called() -> None:
    """R142: a function's self time is its duration less its callees' on the
    same thread, and threads do not nest into each other (bug caught: an
    outer step loop ranked first by time its callees spent, or a call on
    another thread subtracted from it)."""

    def call(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {
            "cat": "python_function",
            "name": name,
            "ts": ts,
            "dur": dur,
            "pid": 1,
            "tid": tid,
        }

    events = [
        call("step", 0, 100),
        call("schedule", 10, 30),
        call("helper", 15, 5),
        call("execute", 50, 40),
        call("other_thread", 20, 60, tid=2),
        call("step", 200, 10),
    ]
    own = {name: (us, n) for name, us, n in bench.python_self_times(events)}
    assert own == {
        "step": (40.0, 2),  # 100 - 30 - 40, and 10
        "schedule": (25.0, 1),
        "helper": (5.0, 1),
        "execute": (40.0, 1),
        "other_thread": (60.0, 1),
    }


def test_profiler_config_is_one_vllm_accepts(tmp_path: Path) -> None:
    """--profile-warmup's --profiler-config parses as vLLM 0.33.0's
    ProfilerConfig (bug caught: a key vLLM does not know, which would stop
    both engines at start on the GPU host)."""
    from vllm.config.profiler import ProfilerConfig

    config = ProfilerConfig(**bench.profiler_config(tmp_path / "trace_on"))
    assert config.profiler == "torch"
    assert config.torch_profiler_dir == str(tmp_path / "trace_on")
    assert config.torch_profiler_with_stack is False
    limited = ProfilerConfig(**bench.profiler_config(tmp_path / "t", max_steps=160))
    assert limited.max_iterations == 160 and limited.ignore_frontend is True
    assert ProfilerConfig(**bench.profiler_config(tmp_path / "t")).max_iterations == 0
    stacks = ProfilerConfig(**bench.profiler_config(tmp_path / "t", with_stack=True))
    assert stacks.torch_profiler_with_stack is True


def test_mode_env_reaches_the_named_mode_only() -> None:
    """R142 (diagnosis in one slot): `--mode-env on:K=V` sets K in the "on"
    engine's environment only, whichever slot it runs in, and a setting
    without a mode or a value is refused. Bug caught: the setting given to
    both engines (then on/off compares the probe with itself)."""
    settings = ["on:KV_CHECKSUM_GIL_PROBE=thread", "off:X=a=b"]
    assert bench.mode_env("on", settings) == {"KV_CHECKSUM_GIL_PROBE": "thread"}
    assert bench.mode_env("off", settings) == {"X": "a=b"}
    for bad in ("KV=1", "both:K=V", "on:K", "on:=V"):
        with pytest.raises(ValueError, match="on\\|off:KEY=VALUE"):
            bench.mode_env("on", [bad])
