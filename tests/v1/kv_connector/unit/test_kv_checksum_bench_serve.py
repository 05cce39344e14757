# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The `vllm bench serve` benchmark's verdict rule and /metrics reader, on
hand-made launch records (no requirement: the benchmark reports R142's cost at
production shape; these tests keep its verdict honest)."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

PATH = Path(__file__).resolve().parents[4] / "benchmarks/benchmark_kv_checksum_serve.py"


bench = load_script("bench_serve", PATH)


def _launch(mode: str, ttft: float, tpot: float, rps: float, **verdicts: float):
    return {
        "mode": mode,
        "results": {
            "w": {
                "median_ttft_ms": ttft,
                "median_tpot_ms": tpot,
                "request_throughput": rps,
                "failed": 0,
            }
        },
        "verdicts": verdicts,
    }


def test_on_inside_off_spread_passes() -> None:
    """Off launches 30.0 / 31.0 ms TTFT (spread 1.0), on 30.4 / 30.8 (mean
    30.6, +0.1 over off's 30.5): inside the spread and under +1.5 ms; 9.9 vs
    9.95 req/s (off spread 0.1) is -0.5 %. Hand-computed expectations."""
    launches = [
        _launch("off", 30.0, 7.0, 10.0),
        _launch("on", 30.4, 7.0, 9.85, verified=20),
        _launch("off", 31.0, 7.1, 9.9),
        _launch("on", 30.8, 7.1, 9.95, verified=20),
    ]
    summary = bench.summarize(launches)
    row = summary["workloads"]["w"]
    assert row["median_ttft_ms"]["on_minus_off"] == pytest.approx(0.1)
    assert row["median_ttft_ms"]["off_spread"] == pytest.approx(1.0)
    assert row["request_throughput"]["relative"] == pytest.approx(
        -0.05 / 9.95, abs=1e-4
    )
    assert summary["consumer_verdicts_on"] == {"verified": 40}
    assert summary["pass"] is True


def test_neighbouring_records_of_opposite_modes_pair() -> None:
    """R142 cost: rounds off, on, on, off, on, off, off, on; TTFT drifts up by
    10 ms per pair and on sits +1, +1, +1, +5 ms above its neighbour of the same
    pair: paired on - off [+1, +1, +1, +5], median +1; throughput ratios on/off
    per pair. A pair of two records of one mode is skipped. Bugs caught: pairs
    across neighbouring pairs (records 1 and 2), off - on, and pairs of one
    mode."""
    ttft = [30.0, 31.0, 41.0, 40.0, 51.0, 50.0, 60.0, 65.0]
    modes = ["off", "on", "on", "off", "on", "off", "off", "on"]
    rps = [10.0, 9.0, 9.0, 10.0, 9.5, 10.0, 10.0, 8.0]
    launches = [
        _launch(mode, t, 7.0, r, verified=1) for mode, t, r in zip(modes, ttft, rps)
    ]
    row = bench.summarize(launches)["workloads"]["w"]
    pairs = row["median_ttft_ms"]["paired"]
    assert pairs["on_minus_off"] == pytest.approx([1.0, 1.0, 1.0, 5.0])
    assert pairs["median_on_minus_off"] == pytest.approx(1.0)
    ratios = row["request_throughput"]["paired"]["on_over_off"]
    assert ratios == pytest.approx([0.9, 0.9, 0.95, 0.8])
    same = [_launch("off", 30.0, 7.0, 10.0), _launch("off", 31.0, 7.0, 10.0)]
    same += [_launch("on", 32.0, 7.0, 10.0, verified=1)]
    assert bench.summarize(same)["workloads"]["w"]["median_ttft_ms"]["paired"] == {}


def test_ttft_over_target_fails_even_inside_a_wide_spread() -> None:
    """A +2 ms TTFT inside a 5 ms off-vs-off spread still fails the +1.5 ms
    target (bug caught: judging by the spread alone)."""
    launches = [
        _launch("off", 30.0, 7.0, 10.0),
        _launch("on", 32.0, 7.0, 10.0, verified=5),
        _launch("off", 35.0, 7.0, 10.0),
        _launch("on", 35.0, 7.0, 10.0, verified=5),
    ]
    row = bench.summarize(launches)["workloads"]["w"]["median_ttft_ms"]
    assert row["on_minus_off"] == pytest.approx(1.0)
    launches[1]["results"]["w"]["median_ttft_ms"] = 34.0  # on mean 34.5, +2.0
    summary = bench.summarize(launches)
    assert summary["workloads"]["w"]["median_ttft_ms"]["inside_spread"] is True
    assert summary["workloads"]["w"]["pass"] is False
    assert summary["pass"] is False


def test_throughput_drop_outside_spread_fails() -> None:
    """On throughput 2 % under off with off launches equal (spread 0) fails
    both the spread and the -1.5 % target (bug caught: the sign of a
    throughput delta read like a latency delta)."""
    launches = [
        _launch("off", 30.0, 7.0, 10.0),
        _launch("on", 30.0, 7.0, 9.8, verified=5),
        _launch("off", 30.0, 7.0, 10.0),
    ]
    row = bench.summarize(launches)["workloads"]["w"]["request_throughput"]
    assert row["inside_spread"] is False
    assert row["meets_target"] is False


def test_unverified_load_or_failed_request_fails_the_run() -> None:
    """Any mismatch or unverified consumer load, or any failed request, makes
    the run fail whatever the timings (bug caught: a fast but unchecked run)."""
    good = [_launch("off", 30.0, 7.0, 10.0), _launch("on", 30.0, 7.0, 10.0)]
    good[1]["verdicts"] = {"verified": 9, "unverified": 1}
    assert bench.summarize(good)["pass"] is False
    good[1]["verdicts"] = {"verified": 10}
    assert bench.summarize(good)["pass"] is True
    good[0]["results"]["w"]["failed"] = 1
    assert bench.summarize(good)["pass"] is False


def test_verdict_counts_sums_labels() -> None:
    """/metrics lines of several label sets add up per verdict; other metrics
    and comments are ignored."""
    name = "vllm:kv_checksum_loads_total"
    page = "\n".join(
        [
            f"# HELP {name} Loads by verdict",
            f'{name}{{engine="0",model_name="m",verdict="verified"}} 7.0',
            f'{name}{{engine="1",model_name="m",verdict="verified"}} 3.0',
            f'{name}{{engine="0",model_name="m",verdict="mismatch"}} 1.0',
            'vllm:kv_checksum_blocks_total{engine="0",verdict="verified"} 99.0',
        ]
    )
    assert bench.verdict_counts(page) == {"verified": 10.0, "mismatch": 1.0}
    assert bench.verdict_counts(None) == {}


def test_together_pairs_use_disjoint_ports() -> None:
    """The off and on pairs of --together start at once on the same host: every
    port of one (API, router, metrics, and the NIXL side channels of up to 8 TP
    ranks from each base) differs from every port of the other (bug caught: the
    on pair's producer side channel shifted onto the off pair's consumer's)."""
    args = bench.argparse.Namespace(
        router_port=8000, prom_port=29000, api_port=8100, side_port=5600
    )
    off = bench.Launch(args, "off", Path("/nonexistent"))
    on = bench.Launch(args, "on", Path("/nonexistent"), port_shift=10)

    def used(launch) -> set[int]:
        ports = set(launch.ports.values())
        for key in ("P_SIDE", "D_SIDE"):
            ports |= {launch.ports[key] + rank for rank in range(8)}
        return ports

    assert not used(off) & used(on)
    assert len(used(off)) == 4 + 16
    assert on.router_url == "http://127.0.0.1:8010"


def test_on_first_puts_the_on_pair_in_the_first_slot() -> None:
    """R142 (a fair on/off cost): --on-first starts the on pair first on the
    launch script's own ports and shifts the off pair, so a second run cancels
    what the slots differ by (bugs caught: the flag naming the slots while the
    ports stay put, or the start order left off-first)."""
    assert list(bench.together_slots(False, 10).items()) == [("off", 0), ("on", 10)]
    assert list(bench.together_slots(True, 10).items()) == [("on", 0), ("off", 10)]
    args = bench.parse_args(["--out", "/nonexistent", "--together", "--on-first"])
    assert args.on_first is True
    assert bench.parse_args(["--out", "/nonexistent"]).on_first is False


def test_round_verdicts_are_counter_deltas(monkeypatch, tmp_path) -> None:
    """A --together pair serves several rounds, and its /metrics counters add
    up over them: a round's verdicts are the counts after minus before (bug
    caught: the second on round reporting the first round's loads again)."""
    args = bench.argparse.Namespace(
        router_port=8000,
        prom_port=29000,
        api_port=8100,
        side_port=5600,
        bench_batch=False,
    )
    launch = bench.Launch(args, "on", tmp_path, port_shift=10)
    pages = iter([{"verified": 10.0}, {"verified": 25.0, "mismatch": 1.0}])
    monkeypatch.setattr(launch, "consumer_verdicts", lambda: next(pages))
    calls = []

    def fake_workload(args, workload, log_dir, router_url):
        calls.append(router_url)
        return {"median_ttft_ms": 1.0}

    monkeypatch.setattr(bench, "run_workload", fake_workload)
    entry: dict = {"mode": "on", "results": {}, "verdicts": {}}
    workload = bench.Workload("w", 8, 1, 1, 1)
    bench.run_round(args, launch, [workload], entry, tmp_path)
    assert entry["verdicts"] == {"verified": 15.0, "mismatch": 1.0}
    assert calls == ["http://127.0.0.1:8010"]
    assert entry["results"] == {"w": {"median_ttft_ms": 1.0}}


def _vllm_bench_parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser


def test_bench_args_parse_with_vllms_own_parser(tmp_path) -> None:
    """Every workload's arguments go through vLLM 0.33.0's bench-serve parser
    with the values meant (bug caught: an option vLLM does not know, which the
    batch runner would only report as a failed run on the GPU host)."""
    args = bench.argparse.Namespace(router_port=8000, model=tmp_path, scale=2)
    parser = _vllm_bench_parser()
    for workload in bench.WORKLOADS:
        argv = bench.bench_args(args, workload, tmp_path, "http://127.0.0.1:8010")
        parsed = parser.parse_args(argv)
        assert parsed.base_url == "http://127.0.0.1:8010"
        assert parsed.random_input_len == workload.input_len
        assert parsed.random_output_len == workload.output_len
        assert parsed.num_prompts == 2 * workload.num_prompts
        assert parsed.max_concurrency == workload.concurrency
        assert parsed.result_filename == f"{workload.name}.json"


def test_batch_runner_keeps_going_after_a_failed_run(monkeypatch) -> None:
    """The batch runner calls vLLM's bench-serve `main` once per argument list
    and a run that raises does not stop the next (bug caught: one bad workload
    losing the rest of the round)."""
    import vllm.benchmarks.serve as serve

    runner = load_script(
        "bench_batch", PATH.parent / "kv_checksum_bench_serve_batch.py"
    )
    seen: list[int] = []

    def fake_main(parsed) -> dict:
        seen.append(parsed.num_prompts)
        if parsed.num_prompts == 1:
            raise RuntimeError("server went away")
        return {}

    monkeypatch.setattr(serve, "main", fake_main)
    base = ["--backend", "vllm", "--model", "m", "--dataset-name", "random"]
    runs = [base + ["--num-prompts", "1"], base + ["--num-prompts", "2"]]
    assert runner.run_all(runs) == 1
    assert seen == [1, 2]


def test_round_with_bench_batch_runs_one_process(monkeypatch, tmp_path) -> None:
    """--bench-batch: a round's workloads go to the batch runner once, in
    order, and no CLI run starts (bug caught: the flag ignored, so the round
    pays vLLM's import once per workload again)."""
    args = bench.argparse.Namespace(
        router_port=8000,
        prom_port=29000,
        api_port=8100,
        side_port=5600,
        bench_batch=True,
    )
    launch = bench.Launch(args, "off", tmp_path)
    monkeypatch.setattr(launch, "consumer_verdicts", lambda: {})
    batches: list[list[str]] = []

    def fake_batch(args, workloads, log_dir, router_url):
        batches.append([w.name for w in workloads])
        return {w.name: {"median_ttft_ms": 2.0} for w in workloads}

    def no_cli(*_a, **_k):
        raise AssertionError("a CLI run started")

    monkeypatch.setattr(bench, "run_workloads_batch", fake_batch)
    monkeypatch.setattr(bench, "run_workload", no_cli)
    entry: dict = {"mode": "off", "results": {}, "verdicts": {}}
    chosen = bench.WORKLOADS[:2]
    bench.run_round(args, launch, chosen, entry, tmp_path)
    assert batches == [[w.name for w in chosen]]
    assert list(entry["results"]) == [w.name for w in chosen]


# The bench's port flags as offsets from one base; each pair takes its port and
# the port 10 above it (the second pair's shift), the side channels 200 above.
_PORT_OFFSETS = {"--api-port": 0, "--side-port": 300, "--router-port": 700}
_PORT_OFFSETS["--prom-port"] = 800


def _free_port_base() -> int:
    """A base (20000-50000) whose every port the fake pairs use is free now,
    tried from one that depends on this process, so two suites at once differ."""
    import socket

    offsets = [0, 100, 300, 400, 500, 600, 700, 800]
    offsets += [offset + 10 for offset in offsets]
    for attempt in range(30):
        base = 20000 + ((os.getpid() % 300) * 100 + attempt * 1000) % 30000
        try:
            for offset in offsets:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port base")


def test_together_bench_batch_dry_run_on_fake_servers(tmp_path) -> None:
    """The whole --together --bench-batch path on CPU: the launch script starts
    two fake P/D pairs behind fake routers at once, each round runs vLLM's
    real bench-serve `main` in one batch process through its pair's router,
    and the on round's consumer verdicts are its own (deltas), the off pair's
    none. Bug caught: the pairs' ports colliding, a round sent to the other
    pair's router, or the batch runner's results not read back."""
    import subprocess

    fake = Path(__file__).resolve().parent / "kv_checksum_fake_server.py"
    python = sys.executable
    cmd = [python, str(PATH), "--out", str(tmp_path / "out"), "--shape", "tiny"]
    cmd += ["--model", str(tmp_path / "model"), "--together", "--bench-batch"]
    cmd += ["--rounds", "off,on", "--workloads", "1k32_c8"]
    cmd += [
        "--serve-cmd",
        f"{python} {fake}",
        "--router-cmd",
        f"{python} {fake} router",
    ]
    base = _free_port_base()
    cmd += ["--startup-timeout", "120"]
    for flag, offset in _PORT_OFFSETS.items():
        cmd += [flag, str(base + offset)]
    subprocess.run(cmd, check=False, timeout=600, capture_output=True)
    record = json.loads((tmp_path / "out/summary.json").read_text())
    off, on = record["launches"]
    assert (off["mode"], on["mode"]) == ("off", "on")
    for entry in (off, on):
        result = entry["results"]["1k32_c8"]
        assert result["completed"] == 64 and not result.get("error")
    assert off["verdicts"] == {}
    assert on["verdicts"]["verified"] >= 64 and on["verdicts"]["mismatch"] == 0
    for name in ("round0_off", "round1_on"):
        assert (tmp_path / "out" / name / "bench_batch.log").exists()
        assert not (tmp_path / "out" / name / "1k32_c8.log").exists()


def test_cuda_ipc_get_reaches_both_pairs_alike(tmp_path) -> None:
    """R142 (a fair on/off cost): --cuda-ipc-get puts
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y into the launch environment of the off and the
    on pair alike, and nothing without it (bugs caught: only the on pair reading
    over CUDA IPC, which would credit checksums with a faster transport; the setting
    leaking into default runs)."""
    args = bench.parse_args(["--out", str(tmp_path), "--cuda-ipc-get"])
    off = bench.Launch(args, "off", tmp_path).environment()
    on = bench.Launch(args, "on", tmp_path, port_shift=10).environment()
    assert off["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == on["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"]
    assert off["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert (off["CHECKSUMS"], on["CHECKSUMS"]) == ("off", "on")
    plain = bench.parse_args(["--out", str(tmp_path)])
    env = bench.Launch(plain, "on", tmp_path).environment()
    assert env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == os.environ.get(
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    )


def test_control_runs_both_pairs_off_and_needs_no_verdicts(tmp_path) -> None:
    """R142 (a fair on/off cost): --control starts the "on" slot with
    checksums off like the off slot, so on - off sizes the pairs' own bias,
    and its run passes with no verdicts, while a verdict there (a pair that
    was not off) fails it. Bugs caught: the flag naming the A/A run while the
    on slot still checksums, and a control run failing for want of verified
    loads."""
    args = bench.parse_args(["--out", str(tmp_path), "--together", "--control"])
    off = bench.Launch(args, "off", tmp_path).environment()
    on = bench.Launch(args, "on", tmp_path, port_shift=10).environment()
    assert (off["CHECKSUMS"], on["CHECKSUMS"]) == ("off", "off")
    plain = bench.parse_args(["--out", str(tmp_path), "--together"])
    assert bench.Launch(plain, "on", tmp_path).environment()["CHECKSUMS"] == "on"
    launches = [_launch("off", 30.0, 7.0, 10.0), _launch("on", 30.0, 7.0, 10.0)]
    assert bench.summarize(launches)["pass"] is False  # a real run needs loads
    assert bench.summarize(launches, control=True)["pass"] is True
    launches[1]["verdicts"] = {"verified": 3}
    assert bench.summarize(launches, control=True)["pass"] is False


class _SlotLaunch:
    """A pair that serves from its slot: the first slot (port shift 0) at 50
    req/s, the second at 45, checksums on 1 req/s slower anywhere."""

    started: list[tuple[str, int]] = []

    def __init__(self, args, mode, log_dir, port_shift=0) -> None:
        self.mode, self.shift, self.proc = mode, port_shift, None
        self.router_url = f"http://{mode}:{8000 + port_shift}"

    def begin(self) -> None:
        _SlotLaunch.started.append((self.mode, self.shift))

    def wait_ready(self) -> float:
        return 1.0

    def consumer_verdicts(self) -> dict:
        return {"verified": 1.0} if self.mode == "on" else {}

    def engine_times(self) -> dict:
        return {"producer": {}, "consumer": {}}

    def stop(self) -> None:
        pass


def test_pair_launches_swap_the_slots_and_split_the_bias(monkeypatch, tmp_path) -> None:
    """R142 (a fair on/off cost): --pair-launches 2 starts the pairs twice,
    the on pair in the second slot then in the first, numbers the rounds on
    across launches, and the summary splits the checksum effect (-1 req/s)
    from the slot bias (-5 req/s) though each launch alone shows -6 or +4.
    Bugs caught: every launch in the same slots (no bias cancels; no split),
    a round's `slot` naming the other pair's, round folders overwritten by
    the second launch, an --append run numbering its launches from 0 again
    (slot_bias would mix two launches' rounds)."""

    def fake_workload(args, workload, log_dir, router_url):
        mode, port = router_url.removeprefix("http://").split(":")
        rate = (50.0 if port == "8000" else 45.0) - (mode == "on")
        return {"request_throughput": rate, "median_ttft_ms": 10.0}

    _SlotLaunch.started = []
    monkeypatch.setattr(bench, "Launch", _SlotLaunch)
    monkeypatch.setattr(bench, "run_workload", fake_workload)
    monkeypatch.setattr(bench, "build_model", lambda *a: None)
    out = tmp_path / "out"
    argv = ["x", "--out", str(out), "--together", "--pair-launches", "2"]
    monkeypatch.setattr(sys, "argv", argv + ["--workloads", "1k32_c8"])
    bench.main()
    assert _SlotLaunch.started == [("off", 0), ("on", 10), ("on", 0), ("off", 10)]
    record = json.loads((out / "summary.json").read_text())
    rounds = record["launches"]
    assert [(r["launch"], r["mode"], r["slot"]) for r in rounds] == [
        (0, "off", "a"),
        (0, "on", "b"),
        (0, "on", "b"),
        (0, "off", "a"),
        (1, "off", "b"),
        (1, "on", "a"),
        (1, "on", "a"),
        (1, "off", "b"),
    ]
    assert sorted(p.name for p in out.glob("round*")) == sorted(
        f"round{i}_{r['mode']}" for i, r in enumerate(rounds)
    )
    row = record["summary"]["workloads"]["1k32_c8"]["request_throughput"]
    assert row["slot_bias"]["effect"] == pytest.approx(-1.0)
    assert row["slot_bias"]["slot_b_minus_a"] == pytest.approx(-5.0)
    assert row["on_minus_off"] == pytest.approx(-1.0)
    assert record["config"]["pair_launches"] == 2
    # A later call appends its launches after the recorded ones.
    monkeypatch.setattr(sys, "argv", argv + ["--workloads", "1k32_c8", "--append"])
    bench.main()
    rounds = json.loads((out / "summary.json").read_text())["launches"]
    assert [r["launch"] for r in rounds[8:]] == [2] * 4 + [3] * 4


def _histograms(**means_ms: tuple[float, float]) -> str:
    """A /metrics page with NAME_seconds sum and count lines (and a bucket
    line each, which must be ignored) for NAME=(total ms, count)."""
    lines = []
    for name, (total_ms, count) in means_ms.items():
        labels = '{engine="0",model_name="model"}'
        lines.append(f'vllm:{name}_seconds_bucket{{le="0.1",model_name="m"}} 99.0')
        lines.append(f"vllm:{name}_seconds_sum{labels} {total_ms / 1000.0}")
        lines.append(f"vllm:{name}_seconds_count{labels} {count}")
    return "\n".join(lines)


def test_engine_times_put_the_ttft_difference_at_an_engine(
    monkeypatch, tmp_path
) -> None:
    """R142 (diagnosis), issue 30: each round records the producer's and the
    consumer's means of vLLM's latency histograms as deltas of that round, and
    the summary puts the on - off difference at the engine and histogram
    where it grew (hand numbers: the on rounds' consumer queue time grows from
    5 to 25 ms a request, nothing else moves). Bugs caught: means of the
    cumulative counters (the on round would read 300/20 = 15 ms), the roles
    swapped, bucket lines summed into the sums, seconds left as seconds."""
    args = bench.argparse.Namespace(
        router_port=8000,
        prom_port=29000,
        api_port=8100,
        side_port=5600,
        bench_batch=False,
    )
    launch = bench.Launch(args, "on", tmp_path, port_shift=10)
    ports = {launch.ports["P_PORT"]: "producer", launch.ports["D_PORT"]: "consumer"}
    # Cumulative (total ms, count) per read: before and after each round.
    reads = iter(
        [
            {"producer": {}, "consumer": {}},
            {
                "producer": {"e2e_request_latency": (300.0, 10)},
                "consumer": {
                    "request_queue_time": (50.0, 10),
                    "nixl_xfer_time": (20.0, 10),
                },
            },
            {
                "producer": {"e2e_request_latency": (300.0, 10)},
                "consumer": {
                    "request_queue_time": (50.0, 10),
                    "nixl_xfer_time": (20.0, 10),
                },
            },
            {
                "producer": {"e2e_request_latency": (600.0, 20)},
                "consumer": {
                    "request_queue_time": (300.0, 20),
                    "nixl_xfer_time": (40.0, 20),
                },
            },
        ]
    )
    pages: dict[str, str] = {}

    def next_read() -> None:
        pages.update({role: _histograms(**m) for role, m in next(reads).items()})

    def fake_get(url: str, timeout: float = 5.0) -> str:
        port = int(url.split(":")[2].split("/")[0])
        return pages[ports[port]]

    monkeypatch.setattr(bench, "http_get", fake_get)
    monkeypatch.setattr(launch, "consumer_verdicts", lambda: {})
    monkeypatch.setattr(bench, "run_workload", lambda *a: {"median_ttft_ms": 1.0})
    workload = bench.Workload("w", 8, 1, 1, 1)
    real = launch.engine_times

    def reading_times() -> dict:
        next_read()
        return real()

    monkeypatch.setattr(launch, "engine_times", reading_times)
    records = []
    for mode in ("off", "on"):
        entry: dict = {"mode": mode, "results": {}, "verdicts": {}}
        bench.run_round(args, launch, [workload], entry, tmp_path)
        records.append(entry)
    assert records[0]["engine_ms"] == {
        "producer": {"e2e_request_latency": pytest.approx(30.0)},
        "consumer": {
            "request_queue_time": pytest.approx(5.0),
            "nixl_xfer_time": pytest.approx(2.0),
        },
    }
    effects = bench.engine_time_effects(records)
    assert effects["consumer"]["request_queue_time"]["on_minus_off"] == pytest.approx(
        20.0
    )
    assert effects["consumer"]["nixl_xfer_time"]["on_minus_off"] == pytest.approx(0.0)
    assert effects["producer"]["e2e_request_latency"]["on_minus_off"] == pytest.approx(
        0.0
    )
    assert bench.summarize(records)["engine_times"] == effects


def test_engine_counts_show_prefix_cache_reuse_per_round(monkeypatch, tmp_path) -> None:
    """R142 (diagnosis), issue 30: every round sends the same seeded prompts, so an
    engine whose later rounds stop hitting its prefix cache would look slower
    for that alone. Each round records vLLM's own counters as deltas of the
    round and the mean prefill tokens computed per request (hand numbers: 64
    queries of 1024 tokens, 1008 hit, 16 computed a request). Bugs caught:
    cumulative counters (the second round would read 128 queries), other
    `prompt_tokens_*` series matched as `prompt_tokens_total` (the
    by-source and bucket lines grow each round too)."""
    args = bench.argparse.Namespace(
        router_port=8000,
        prom_port=29000,
        api_port=8100,
        side_port=5600,
        bench_batch=False,
    )
    launch = bench.Launch(args, "on", tmp_path)
    labels = '{engine="0",model_name="model"}'

    def page(rounds: int) -> str:
        return "\n".join(
            [
                f"vllm:prefix_cache_queries_total{labels} {64 * 1024 * rounds}",
                f"vllm:prefix_cache_hits_total{labels} {64 * 1008 * rounds}",
                f"vllm:prompt_tokens_total{labels} {64 * 1024 * rounds}",
                f'vllm:prompt_tokens_by_source_total{{source="local"}} {7 * rounds}',
                f"vllm:prompt_tokens_cached_total{labels} {64 * 1008 * rounds}",
                f'vllm:request_prefill_kv_computed_tokens_bucket{{le="16"}} '
                f"{640 * rounds}",
                f"vllm:request_prefill_kv_computed_tokens_sum{labels} "
                f"{64 * 16 * rounds}",
                f"vllm:request_prefill_kv_computed_tokens_count{labels} {64 * rounds}",
            ]
        )

    reads = iter([0, 1, 1, 2])
    current = {"n": 0}

    def fake_get(url: str, timeout: float = 5.0) -> str:
        return page(current["n"])

    real = launch.engine_times

    def reading_times() -> dict:
        current["n"] = next(reads)
        return real()

    monkeypatch.setattr(bench, "http_get", fake_get)
    monkeypatch.setattr(launch, "consumer_verdicts", lambda: {})
    monkeypatch.setattr(launch, "engine_times", reading_times)
    monkeypatch.setattr(bench, "run_workload", lambda *a: {"median_ttft_ms": 1.0})
    records = []
    for mode in ("off", "on"):
        entry: dict = {"mode": mode, "results": {}, "verdicts": {}}
        bench.run_round(
            args, launch, [bench.Workload("w", 8, 1, 1, 1)], entry, tmp_path
        )
        records.append(entry)
    want = {
        "prefix_cache_queries_total": 64 * 1024,
        "prefix_cache_hits_total": 64 * 1008,
        "prompt_tokens_total": 64 * 1024,
        "prompt_tokens_cached_total": 64 * 1008,
        "prefill_computed_tokens_mean": 16.0,
    }
    for record in records:
        assert record["engine_counts"]["consumer"] == pytest.approx(want)
    effects = bench.summarize(records)["engine_counts"]
    assert effects["producer"]["prefill_computed_tokens_mean"]["on_minus_off"] == 0
