# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""External-load verification on one GPU through an external KV cache:
LMCacheConnectorV1 (lmcache 0.5.6, local CPU backend) or vLLM's
ExampleConnector (`--connector`), a prefix-reuse workload against one `vllm
serve` per mode, run by scripts/lmcache_gpu.sh.

Modes: plain (no connector: reference outputs), off (checksums off), on
(enable_kv_checksum and kv_checksum_verify_external_loads), fault (on plus the
package's fault injector) and corrupt (on, with a fault made outside the
package: for LMCache, lmcache_corrupt/sitecustomize.py flipping a byte of
chunks its local CPU backend hands out; for ExampleConnector, a byte flipped
in every file it stored). The GPU prefix cache is kept small
(--num-gpu-blocks-override) so the shared prefix is evicted between its uses
and comes back from the connector. Writes OUT/summary.json (`MODE_equals_off`
and `MODE_equals_plain`: the same outputs, none of them an HTTP error), each
server's log and its `vllm:kv_checksum_*` and prefix-cache /metrics lines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import sys
import time
from typing import Any

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "disaggregated"))
from kv_checksum_serve_pd import SERVE, VOCAB, build_model, log  # noqa: E402

HIT = re.compile(r"LMCache hit tokens: (\d+), need to load: (\d+)")
METRIC = re.compile(r"^(vllm:kv_checksum_\S+|vllm:\S*prefix_cache\S*)\s+(\S+)$")
MODES = ("off", "on", "fault", "corrupt")
CONNECTORS = ("LMCacheConnectorV1", "ExampleConnector")
EXTERNAL = re.compile(r'^vllm:kv_checksum_external_loads_total\{.*verdict="(\w+)"')


def kv_transfer_config(mode: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine's KV transfer config; None for mode "plain" (no connector:
    the reference outputs, every prefix computed by vLLM itself)."""
    if mode == "plain":
        return None
    extra: dict[str, Any] = {}
    if args.connector == "ExampleConnector":  # vLLM's own file store
        extra["shared_storage_path"] = os.path.join(args.out, f"storage-{mode}")
    if mode != "off":
        extra.update(enable_kv_checksum=True, kv_checksum_verify_external_loads=True)
    extra.update(json.loads(args.extra_config))
    if mode == "fault":
        extra["kv_checksum_fault_injection"] = {
            "rate": 0.5,
            "kinds": ["bit_flip"],
            "seed": 0,
        }
    return {
        "kv_connector": args.connector,
        "kv_role": "kv_both",
        # A load that fails verification is recomputed, not failed (vLLM's
        # default "fail" would turn every caught corruption into an error).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def server_env(mode: str, connector: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_USE_FLASHINFER_SAMPLER="0",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        PYTHONHASHSEED="0",  # LMCache's chunk hashes, stable across processes
        LMCACHE_LOCAL_CPU="True",
        LMCACHE_CHUNK_SIZE="16",
        LMCACHE_MAX_LOCAL_CPU_SIZE="2",
        LMCACHE_TRACK_USAGE="false",
        LMCACHE_DISABLE_BANNER="1",
    )
    if mode == "corrupt" and connector == "LMCacheConnectorV1":
        corrupt = os.path.join(REPO, "scripts", "lmcache_corrupt")
        env["PYTHONPATH"] = corrupt + os.pathsep + env.get("PYTHONPATH", "")
        env["KVC_LMCACHE_CORRUPT"] = "1"
    return env


def start(mode: str, args: argparse.Namespace, port: int) -> Any:
    import subprocess

    cmd = [sys.executable, *SERVE, args.model, "--served-model-name", "tiny"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    cmd += ["--max-model-len", str(args.max_model_len), "--block-size", "16"]
    cmd += ["--dtype", "bfloat16"]
    cmd += ["--num-gpu-blocks-override", str(args.gpu_blocks), "--enforce-eager"]
    cmd += ["--gpu-memory-utilization", "0.3", "--max-num-seqs", "4"]
    config = kv_transfer_config(mode, args)
    if config is not None:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    path = os.path.join(args.out, f"{mode}.log")
    out = open(path, "wb")  # noqa: SIM115 - the server's lifetime
    out.write((" ".join(cmd) + "\n").encode())
    out.flush()
    proc = subprocess.Popen(
        cmd,
        env=server_env(mode, args.connector),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + args.start_timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    return proc if proc.poll() is None and time.time() < deadline else None


def stop(proc: Any) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except Exception:
        with contextlib.suppress(Exception):
            os.killpg(proc.pid, signal.SIGKILL)


def workload(args: argparse.Namespace) -> list[str]:
    """The shared prefix with a new suffix, fillers that evict it from the
    GPU prefix cache, and the prefix again, `rounds` times. ExampleConnector
    finds only whole prompts it stored, so its suffix stays the same."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(4, VOCAB)}" for _ in range(n))

    prefix = words(args.prefix_len)
    same = args.connector == "ExampleConnector"
    suffix = words(8)
    prompts = []
    for _ in range(args.rounds):
        prompts.append(prefix + " " + (suffix if same else words(8)))
        prompts += [words(args.filler_len) for _ in range(args.fillers)]
    prompts.append(prefix + " " + (suffix if same else words(8)))
    return prompts


def corrupt_stored_files(storage: str, flipped: dict[str, int]) -> int:
    """Mode corrupt of ExampleConnector: flip one byte of tensor data near the
    end of every file it stored since the last call (a fault on its disk, made
    outside the package); `flipped` keeps each file's mtime after its flip, so
    a file is flipped once per write. Returns the number of files changed."""
    changed = 0
    for root, _, names in os.walk(storage):
        for name in names:
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(root, name)
            if flipped.get(path) == os.stat(path).st_mtime_ns:
                continue
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                if size < 256:
                    continue
                f.seek(size - 64)
                byte = f.read(1)
                f.seek(size - 64)
                f.write(bytes([byte[0] ^ 0x40]))
            flipped[path] = os.stat(path).st_mtime_ns
            changed += 1
    return changed


def run_mode(mode: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    log(f"{mode}: starting")
    proc = start(mode, args, port)
    result: dict[str, Any] = {"mode": mode, "started": proc is not None}
    if proc is None:
        return result
    outputs = []
    flipped: dict[str, int] = {}
    flips = 0
    storage = os.path.join(args.out, f"storage-{mode}")
    try:
        for i, prompt in enumerate(workload(args)):
            body: dict[str, Any] = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0.0,
                "seed": 0,
            }
            r = requests.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json=body,
                timeout=120,
                headers={"X-Request-Id": f"{mode}-{i}"},
            )
            outputs.append(
                r.json()["choices"][0]["text"] if r.ok else f"HTTP {r.status_code}"
            )
            if mode == "corrupt" and args.connector == "ExampleConnector":
                flips += corrupt_stored_files(storage, flipped)
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        stop(proc)
    lines = [ln for ln in text.splitlines() if METRIC.match(ln)]
    with open(os.path.join(args.out, f"{mode}.metrics"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{mode}.log"), errors="replace") as f:
        server_log = f.read()
    hits = [(int(a), int(b)) for a, b in HIT.findall(server_log)]
    result.update(
        outputs=outputs,
        metrics={ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines},
        external_verdicts={
            m.group(1): float(ln.rsplit(" ", 1)[1])
            for ln in lines
            if (m := EXTERNAL.match(ln))
        },
        lmcache_loads=sum(1 for _, need in hits if need > 0),
        lmcache_loaded_tokens=sum(need for _, need in hits),
        degraded="degraded mode" in server_log,
        torch_baseline_ops="stays on the torch baseline" in server_log,
        failed_verification=server_log.count("failed verification"),
        corruptions=server_log.count("KVC corrupt:") + flips,
        injected=server_log.count("KV checksum fault injection:"),
    )
    brief = {k: v for k, v in result.items() if k != "outputs"}
    log(f"{mode}: {json.dumps(brief)[:1500]}")
    return result


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two modes served every request and gave the same outputs (two engines
    that failed alike are not equal: on 2026-12-07 every request of LMCache's
    V3 run ended in HTTP 500, in modes off and on alike)."""
    outputs = a.get("outputs")
    return (
        outputs is not None
        and outputs == b.get("outputs")
        and not any(o.startswith("HTTP ") for o in outputs)
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="/tmp/kv-checksum-serve-tiny")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {MODES} and plain")
    p.add_argument("--connector", choices=CONNECTORS, default=CONNECTORS[0])
    # vLLM refuses to start unless the GPU blocks hold one max-length request.
    p.add_argument("--gpu-blocks", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--filler-len", type=int, default=600)
    p.add_argument("--fillers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=240)
    # Two drivers at once on one GPU (LMCache and ExampleConnector): ports apart.
    p.add_argument("--port", type=int, default=8300, help="first mode's port")
    # More of the connector's settings, in every mode with a connector (e.g.
    # '{"use_native": true}': vLLM's own copy of LMCache's adapter).
    p.add_argument("--extra-config", default="{}", help="JSON object")
    args = p.parse_args()
    if args.gpu_blocks * 16 < args.max_model_len:
        p.error("--gpu-blocks x 16 tokens must hold --max-model-len")
    os.makedirs(args.out, exist_ok=True)
    build_model(args)
    results: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {"modes": results}
    for i, mode in enumerate(args.modes.split(",")):
        results[mode] = run_mode(mode, args, args.port + i)
        for ref in ("off", "plain"):
            for other in results:
                if ref in results and other not in (ref, "plain"):
                    summary[f"{other}_equals_{ref}"] = same_outputs(
                        results[other], results[ref]
                    )
        # After every mode: a call cut by its time limit keeps what ran.
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    on = results.get("on", {})
    loads = on.get("lmcache_loads", 0) + on.get("external_verdicts", {}).get(
        "verified", 0
    )
    ok = bool(summary.get("on_equals_off")) and loads > 0
    ok = ok and not any(r.get("degraded") for r in results.values())
    log(f"on_equals_off={summary.get('on_equals_off')} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
