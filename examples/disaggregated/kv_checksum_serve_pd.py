# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV checksums the way users run P/D: `vllm serve` instances behind a proxy.

On one GPU this starts `vllm serve` processes with NixlConnector (pull mode),
plays the P/D proxy protocol of vLLM's toy proxy itself (the producer gets the
client's request with ``do_remote_decode`` and ``max_tokens`` 1; the
``kv_transfer_params`` it returns go to the consumer unchanged, ``kv_checksums``
included) and reads verdicts from each consumer's ``/metrics`` and log.

Part ``serve`` (the guide's Quick start configs):
  producer        checksums on
  consumer        checksums on, fail-closed, kv_load_failure_policy=recompute
  consumer_off    checksums off: the reference output of every P/D request
  consumer_faults the consumer plus the fault injector
Each prompt goes producer -> consumer, -> consumer_off and -> consumer_faults
(a fresh producer request each), one at a time and then ``--concurrency`` at
once. Pass: every consumer load verified in ``/metrics``, outputs equal to
consumer_off's, every injected fault a mismatch in the log and the metrics and
the request still answered like consumer_off.

Part ``stale`` (the stale-read incident, no injector): producers whose NIXL
lease (``kv_lease_duration``) is 2 s and whose KV cache is small answer the
prefill requests; the driver waits past the lease, so vLLM frees those blocks,
sends other prompts to the producers so the blocks are reused, then lets the
consumers pull. A stock producer (checksums off) -> consumer_off shows the
incident; a checksums-on producer -> consumer_open (fail-open) and -> consumer
(fail-closed + recompute) shows it caught. Right answer: a fresh P/D request of
the same prompt through consumer_off.

Usage on a GPU host with vLLM 0.33.0, NIXL, the `vllm serve` extras and this
package importable (e.g. ``PYTHONPATH=/tmp/site``)::

    python examples/disaggregated/kv_checksum_serve_pd.py --out /tmp/serve_pd

Writes OUT/summary.json (checks, counts, metrics), OUT/flows.json (every
request's tokens) and OUT/servers.tar.gz (logs, /metrics pages); exits 0 when
every check passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import ctypes
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_checksum_chaos_plan import ServerSpec, effective_injections  # noqa: E402
from kv_checksum_chaos_plan import (  # noqa: E402
    kv_transfer_config as chaos_kv_transfer_config,
)

SERVE = ["-m", "vllm.entrypoints.cli.main", "serve"]
VOCAB = 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
NULL_REMOTE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MISMATCH = re.compile(r"KV checksum mismatch for request (\S+?):")
EXPIRED_READ = "Potentially invalid KV blocks for unrecognized request"

# Run in a child python: a random tiny Qwen3 and a word-level tokenizer
# ("t<id>" is token <id>), so prompt lengths are exact and no hub is needed.
MODEL_SCRIPT = r"""
import os, sys
path, vocab, max_pos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
specials = sys.argv[4].split(",")
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen3Config, Qwen3ForCausalLM
try:
    from transformers import PreTrainedTokenizerFast as Fast
except ImportError:
    from transformers import TokenizersBackend as Fast
torch.manual_seed(0)
config = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=max_pos, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                     initializer_range=0.08)
Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
words = {t: i for i, t in enumerate(specials)}
words.update({f"t{i}": i for i in range(len(specials), vocab)})
tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.add_special_tokens(specials)
Fast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
     unk_token="<unk>", model_max_length=max_pos).save_pretrained(path)
"""

try:
    _LIBC: Any = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _end_with_driver() -> None:
    """In a server child before exec: get SIGTERM when the driver dies."""
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def serve_env(side_port: int) -> dict[str, str]:
    """The environment of one `vllm serve` process on this offline host: no
    FlashInfer sampler, no hub, no usage stats, its own NIXL side channel."""
    env = dict(os.environ)
    env.pop("VLLM_PORT", None)
    env.update(
        VLLM_USE_FLASHINFER_SAMPLER="0",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
    )
    return env


@dataclass
class Server:
    """One `vllm serve` process and how to reach it."""

    name: str
    port: int
    side_port: int
    checksums: bool
    fail_closed: bool = False
    faults: float = 0.0
    lease_s: int | None = None
    num_blocks: int = 2048
    proc: subprocess.Popen | None = None
    log_path: str = ""
    started_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict[str, Any]:
        """NIXL pull as the chaos runs build it; fail-closed servers recompute."""
        spec = ServerSpec(
            self.name,
            self.port,
            self.side_port,
            "consumer" if self.fail_closed else "producer",
            checksums=self.checksums,
            fail_closed=self.fail_closed,
            policy="recompute" if self.fail_closed else None,
            faults=self.faults,
            lease_s=self.lease_s,
        )
        return chaos_kv_transfer_config(spec, "nixl-pull")

    def start(self, args: argparse.Namespace) -> None:
        self.log_path = os.path.join(args.out, f"{self.name}.log")
        cmd = [sys.executable, *SERVE, args.model, "--served-model-name", "tiny"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--gpu-memory-utilization", str(args.gpu_util)]
        cmd += ["--max-model-len", str(args.max_model_len), "--block-size", "16"]
        cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        # A fixed KV cache size skips vLLM's memory profiling, which fails when
        # servers sharing the GPU free memory while another one profiles.
        cmd += ["--kv-cache-memory-bytes", str(1 << 30)]
        # Whole prompts in one step even 16 at a time: chunk boundaries that
        # depend on the load would change the KV numerically.
        cmd += ["--max-num-batched-tokens", str(args.max_batched_tokens)]
        cmd += ["--dtype", "bfloat16", "--seed", "0", "--enforce-eager"]
        cmd += ["--enable-prompt-tokens-details"]
        cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        env = serve_env(self.side_port)
        if args.batch_invariant:
            env["VLLM_BATCH_INVARIANT"] = "1"
        with open(self.log_path, "wb") as out:
            out.write((" ".join(cmd) + "\n").encode())
            out.flush()
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_end_with_driver,  # noqa: PLW1509 - no threads yet
            )
        self._t0 = time.time()

    def wait_ready(self, deadline: float) -> bool:
        while time.time() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    self.started_s = round(time.time() - self._t0, 1)
                    return True
            except requests.RequestException:
                pass
            time.sleep(1)
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@dataclass
class Flow:
    """One client request through the proxy protocol, and what came back."""

    request_id: str
    prompt_len: int
    consumer: str
    producer_status: int = 0
    consumer_status: int = 0
    has_checksums: bool = False
    tokens: list[int] | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def build_model(args: argparse.Namespace) -> None:
    if os.path.exists(os.path.join(args.model, "tokenizer.json")):
        return
    os.makedirs(args.model, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-c",
            MODEL_SCRIPT,
            args.model,
            str(VOCAB),
            "4096",
            ",".join(SPECIALS),
        ],
        check=True,
        timeout=300,
    )


def make_prompts(count: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(
            f"t{rng.randrange(len(SPECIALS), VOCAB)}"
            for _ in range(rng.randint(lo, hi))
        )
        for _ in range(count)
    ]


def post(
    server: Server, body: dict, request_id: str, timeout: float
) -> tuple[int, Any]:
    try:
        r = requests.post(
            server.url + "/v1/completions",
            json=body,
            headers={"X-Request-Id": request_id},
            timeout=timeout,
        )
    except requests.RequestException as e:
        return -1, repr(e)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:500]


def client_body(prompt: str, args: argparse.Namespace, salt: str) -> dict[str, Any]:
    """A client's completion request; the cache salt (unique per request) keeps
    every request off the prefix caches, so each load moves the whole prompt."""
    return {
        "cache_salt": salt,
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def prefill(
    producer: Server, prompt: str, rid: str, args: argparse.Namespace
) -> tuple[int, Any]:
    """The proxy's producer request: max_tokens 1, remote decode, no streaming."""
    body = client_body(prompt, args, rid)
    body.update(max_tokens=1, stream=False, kv_transfer_params=dict(NULL_REMOTE))
    code, reply = post(producer, body, rid, args.timeout)
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    return code, params


def decode(
    consumer: Server,
    prompt: str,
    params: Any,
    rid: str,
    flow: Flow,
    args: argparse.Namespace,
) -> Flow:
    """The proxy's consumer request: the client's, producer params unchanged."""
    body = client_body(prompt, args, rid)
    if params:
        body["kv_transfer_params"] = params
    code, reply = post(consumer, body, rid, args.timeout)
    flow.consumer_status = code
    try:
        flow.tokens = list(reply["choices"][0]["token_ids"])
    except (KeyError, IndexError, TypeError):
        flow.error = f"consumer {code}: {str(reply)[:300]}"
    return flow


def pd(
    producer: Server, consumer: Server, prompt: str, tag: str, args: argparse.Namespace
) -> Flow:
    rid = f"{tag}-{uuid.uuid4().hex[:12]}"
    flow = Flow(rid, len(prompt.split()), consumer.name)
    flow.producer_status, params = prefill(producer, prompt, rid, args)
    if flow.producer_status != 200 or not isinstance(params, dict):
        flow.error = f"producer {flow.producer_status}"
        return flow
    flow.has_checksums = bool(params.get("kv_checksums"))
    return decode(consumer, prompt, params, rid, flow, args)


def metrics(server: Server, out: str) -> dict[str, float]:
    """Samples of the checksum and NIXL counters in the server's /metrics."""
    try:
        text = requests.get(server.url + "/metrics", timeout=30).text
    except requests.RequestException as e:
        log(f"{server.name}: /metrics failed: {e!r}")
        return {}
    with open(os.path.join(out, f"metrics_{server.name}.txt"), "w") as f:
        f.write(text)
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if (
            line.startswith(("vllm:kv_checksum", "vllm:nixl_num"))
            and "_created" not in line
        ):
            key, _, value = line.rpartition(" ")
            samples[re.sub(r'(model_name|engine)="[^"]*",?', "", key)] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    return sum(
        v
        for k, v in samples.items()
        if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())
    )


def run_flows(
    producer: Server,
    consumers: list[Server],
    prompts: list[str],
    tag: str,
    concurrency: int,
    args: argparse.Namespace,
) -> dict[str, list[Flow]]:
    """Every prompt through producer -> each consumer; `concurrency` at once.

    A consumer listed twice gets every prompt twice; its second pass is keyed
    ``<name>_again`` (the control of run-to-run differences).
    """
    flows: dict[str, list[Flow]] = {}
    for consumer in consumers:
        key = consumer.name if consumer.name not in flows else consumer.name + "_again"
        with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
            flows[key] = list(
                pool.map(
                    lambda p, c=consumer: pd(producer, c, p, tag, args),  # type: ignore[misc]
                    prompts,
                )
            )
    return flows


def local_answers(server: Server, prompts: list[str], args: argparse.Namespace) -> list:
    """Each prompt computed by `server` alone (what a recompute computes)."""
    answers = []
    for i, prompt in enumerate(prompts):
        rid = f"local-{i}-{uuid.uuid4().hex[:8]}"
        code, reply = post(server, client_body(prompt, args, rid), rid, args.timeout)
        try:
            answers.append(list(reply["choices"][0]["token_ids"]))
        except (KeyError, IndexError, TypeError):
            answers.append(None)
    return answers


def compare(
    mine: list[Flow], ref: list[Flow], local: list, reported: set[str]
) -> dict[str, Any]:
    """Counts of one consumer's flows against consumer_off's and the local answers."""
    equal = [f.tokens is not None and f.tokens == r.tokens for f, r in zip(mine, ref)]
    for f, r, same, lo in zip(mine, ref, equal, local):
        f.extra.update(equal_to_off=same, equal_to_local=f.tokens == lo)
        f.extra["reported"] = any(f.request_id in m for m in reported)
        f.extra["off_tokens"] = r.tokens
    return {
        "requests": len(mine),
        "ok": sum(f.consumer_status == 200 and f.tokens is not None for f in mine),
        "off_ok": sum(r.tokens is not None for r in ref),
        "with_checksums": sum(f.has_checksums for f in mine),
        "equal_to_off": sum(equal),
        "reported_equal_to_off": sum(
            f.extra["reported"] and f.extra["equal_to_off"] for f in mine
        ),
        "reported_equal_to_local": sum(
            f.extra["reported"] and f.extra["equal_to_local"] for f in mine
        ),
        "reported": sum(f.extra["reported"] for f in mine),
        "off_equal_to_local": sum(
            r.tokens is not None and r.tokens == lo for r, lo in zip(ref, local)
        ),
        "errors": [f.error for f in mine if f.error][:5],
    }


def serve_part(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    producer, consumer = servers["producer"], servers["consumer"]
    off, faults = servers["consumer_off"], servers["consumer_faults"]
    consumers = [consumer, off, faults, off]
    phases = {
        "sequential": (make_prompts(args.num_sequential, 20, args.max_prompt, 1), 1),
        "concurrent": (
            make_prompts(args.num_concurrent, 20, args.max_prompt, 2),
            args.concurrency,
        ),
    }
    t = time.time()
    flows = {
        phase: run_flows(producer, consumers, prompts, phase[:3], width, args)
        for phase, (prompts, width) in phases.items()
    }
    local = {phase: local_answers(off, p, args) for phase, (p, _) in phases.items()}
    log(f"serve part: requests done in {time.time() - t:.0f} s")
    n = sum(len(p) for p, _ in phases.values())
    result: dict[str, Any] = {"requests_per_consumer": n, "flows": {}}
    for name in (consumer.name, faults.name):
        text = servers[name].log_text()
        injected, no_effect = effective_injections(text)
        mismatched = set(MISMATCH.findall(text))
        samples = metrics(servers[name], args.out)
        result[name] = {
            phase: compare(
                flows[phase][name], flows[phase][off.name], local[phase], mismatched
            )
            for phase in phases
        }
        result[name].update(
            loads=total(samples, "vllm:kv_checksum_loads_total"),
            verified=total(samples, "vllm:kv_checksum_loads_total", verdict="verified"),
            mismatch=total(samples, "vllm:kv_checksum_loads_total", verdict="mismatch"),
            unverified=total(
                samples, "vllm:kv_checksum_loads_total", verdict="unverified"
            ),
            injected_requests=len(injected),
            injections_without_effect=len(no_effect),
            mismatch_requests=len(mismatched),
            injected_and_reported=len(injected & mismatched),
            nixl_failed_transfers=total(
                samples, "vllm:nixl_num_failed_transfers_total"
            ),
        )
        result["flows"][name] = {
            phase: [vars(f) for f in flows[phase][name]] for phase in phases
        }
    result["control: consumer_off twice, equal outputs"] = {
        phase: sum(
            a.tokens is not None and a.tokens == b.tokens
            for a, b in zip(flows[phase][off.name], flows[phase][off.name + "_again"])
        )
        for phase in phases
    }
    c, f = result[consumer.name], result[faults.name]

    def every(row: dict[str, Any], key: str) -> bool:
        return all(row[phase][key] == row[phase]["requests"] for phase in phases)

    result["checks"] = {
        "consumer: every request answered": every(c, "ok") and every(c, "off_ok"),
        "consumer: kv_checksums in every producer response": every(c, "with_checksums"),
        "consumer: loads_total{verified} == requests": c["verified"] == n == c["loads"],
        "consumer: outputs equal consumer_off": every(c, "equal_to_off"),
        "faults: some faults injected": f["injected_requests"] > 0,
        "faults: every injected fault a mismatch in the log": (
            f["injected_and_reported"]
            == f["injected_requests"]
            == f["mismatch_requests"]
        ),
        "faults: loads_total{mismatch} == injected": f["mismatch"]
        == f["injected_requests"],
        "faults: no unverified load": f["unverified"] == 0,
        "faults: every request answered": every(f, "ok"),
        # A consumer that recomputes prompts while others decode changes the
        # batches of those decodes: compare outputs one request at a time.
        "faults: verified loads equal consumer_off (sequential)": (
            f["sequential"]["equal_to_off"] - f["sequential"]["reported_equal_to_off"]
            == f["sequential"]["requests"] - f["sequential"]["reported"]
        ),
        "faults: recomputed requests equal a local computation (sequential)": (
            f["sequential"]["reported_equal_to_local"] == f["sequential"]["reported"]
        ),
    }
    return result


def stale_part(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    """The stale-read incident: pulls after the producer's lease expired."""
    stock, lease = servers["producer_lease_off"], servers["producer_lease"]
    off, opened, closed = (
        servers["consumer_off"],
        servers["consumer_open"],
        servers["consumer"],
    )
    prompts = make_prompts(args.num_stale, 24, 120, seed=3)
    fillers = make_prompts(args.num_fillers, 400, 600, seed=4)
    params: dict[str, list[tuple[str, Any]]] = {}
    for producer in (stock, lease):
        pairs = []
        for i, prompt in enumerate(prompts):
            rid = f"stale-{producer.name}-{i}-{uuid.uuid4().hex[:8]}"
            code, p = prefill(producer, prompt, rid, args)
            pairs.append((rid, p if code == 200 else None))
        params[producer.name] = pairs
    time.sleep(args.lease + 2.0)  # past the lease: the producers free those blocks
    for producer in (stock, lease):
        for i, filler in enumerate(fillers):  # other requests reuse the freed blocks
            body = client_body(filler, args, f"filler-{i}")
            body["max_tokens"] = 1
            post(producer, body, f"filler-{producer.name}-{i}", args.timeout)
    reference = run_flows(servers["producer"], [off], prompts, "stale-ref", 1, args)[
        off.name
    ]
    runs = {
        "off (stock producer)": (stock, off),
        "fail-open": (lease, opened),
        "fail-closed + recompute": (lease, closed),
    }
    before = {s.name: s.log_text().count("\n") for s in (off, opened, closed)}
    result: dict[str, Any] = {"stale_prefills": len(prompts), "fillers": len(fillers)}
    for label, (producer, consumer) in runs.items():
        flows = []
        for (rid, p), prompt in zip(params[producer.name], prompts):
            flow = Flow(f"{rid}-{consumer.name}", len(prompt.split()), consumer.name)
            flow.producer_status = 200 if p else 0
            flows.append(decode(consumer, prompt, p, flow.request_id, flow, args))
        new_lines = consumer.log_text().splitlines()[before[consumer.name] :]
        reported = {m for line in new_lines for m in MISMATCH.findall(line)}
        result[label] = {
            "loads": len(flows),
            "http_200": sum(f.consumer_status == 200 for f in flows),
            "right_answers": sum(
                f.tokens is not None and f.tokens == r.tokens
                for f, r in zip(flows, reference)
            ),
            "wrong_answers": sum(
                f.tokens is not None and f.tokens != r.tokens
                for f, r in zip(flows, reference)
            ),
            "mismatches_logged": sum(
                any(f.request_id in m for m in reported) for f in flows
            ),
        }
    for server in (stock, lease, off, opened):
        samples = metrics(server, args.out)
        result[f"{server.name} metrics"] = {
            k: v for k, v in samples.items() if v and "bucket" not in k
        }
        for name in ("failed_transfers", "failed_notifications", "kv_expired_reqs"):
            key = f"vllm:nixl_num_{name}_total"
            result[f"{server.name} metrics"].setdefault(key, total(samples, key))
        result[f"{server.name} '{EXPIRED_READ}' lines"] = server.log_text().count(
            EXPIRED_READ
        )
    o, fo, fc = (
        result["off (stock producer)"],
        result["fail-open"],
        result["fail-closed + recompute"],
    )
    n = len(prompts)
    result["checks"] = {
        "off: stale loads answered with HTTP 200": o["http_200"] == n,
        "off: some stale answers wrong (incident reproduced)": o["wrong_answers"] > 0,
        "fail-open: every wrong answer's load reported": (
            fo["mismatches_logged"] >= fo["wrong_answers"] > 0
        ),
        "fail-closed: stale loads reported": fc["mismatches_logged"] > 0,
        "fail-closed: every answer right": fc["right_answers"] == n
        or fc["equal_to_local"] == n,
    }
    return result


def pack(out: str) -> None:
    """Server logs and /metrics pages into one archive beside summary.json."""
    names = [n for n in os.listdir(out) if n.endswith((".log", ".txt"))]
    if names:
        subprocess.run(["tar", "-czf", "servers.tar.gz", *names], cwd=out, check=False)
        for name in names:
            os.remove(os.path.join(out, name))


def make_servers(parts: set[str]) -> dict[str, Server]:
    servers = {
        "producer": Server("producer", 8100, 5600, checksums=True),
        "consumer": Server("consumer", 8200, 5700, checksums=True, fail_closed=True),
        "consumer_off": Server("consumer_off", 8300, 5800, checksums=False),
    }
    if "serve" in parts:
        servers["consumer_faults"] = Server(
            "consumer_faults", 8400, 5900, checksums=True, fail_closed=True, faults=0.3
        )
    if "stale" in parts:
        servers["producer_lease_off"] = Server(
            "producer_lease_off", 8500, 6000, checksums=False, lease_s=2, num_blocks=256
        )
        servers["producer_lease"] = Server(
            "producer_lease", 8600, 6100, checksums=True, lease_s=2, num_blocks=256
        )
        servers["consumer_open"] = Server("consumer_open", 8700, 6200, checksums=True)
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="/tmp/kv-checksum-serve-tiny")
    parser.add_argument("--parts", default="serve,stale")
    parser.add_argument("--num-sequential", type=int, default=60)
    parser.add_argument("--num-concurrent", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-stale", type=int, default=24)
    parser.add_argument("--num-fillers", type=int, default=24)
    parser.add_argument("--lease", type=int, default=2)
    parser.add_argument("--max-prompt", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-util", type=float, default=0.08)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--startup-timeout", type=float, default=240)
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="VLLM_BATCH_INVARIANT=1 in every server, so concurrent batches do "
        "not change outputs and consumers can be compared token for token",
    )
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.parts.split(","))
    build_model(args)
    servers = make_servers(parts)
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    try:
        for server in servers.values():
            server.start(args)
        deadline = time.time() + args.startup_timeout
        for server in servers.values():
            if not server.wait_ready(deadline):
                log(f"{server.name} did not start:\n{server.tail()}")
                summary["startup_failed"] = server.name
                return 2
        summary["startup_s"] = {s.name: s.started_s for s in servers.values()}
        log(f"servers up: {summary['startup_s']}")
        if "serve" in parts:
            summary["serve"] = serve_part(servers, args)
        if "stale" in parts:
            summary["stale"] = stale_part(servers, args)
    finally:
        for server in servers.values():
            server.stop()
        flows = {part: summary.get(part, {}).pop("flows", None) for part in ("serve",)}
        with open(os.path.join(args.out, "flows.json"), "w") as f:
            json.dump(flows, f, default=str)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        pack(args.out)
    checks = {
        f"{part}: {name}": ok
        for part in ("serve", "stale")
        for name, ok in summary.get(part, {}).get("checks", {}).items()
    }
    for name, ok in checks.items():
        log(f"{'PASS' if ok else 'FAIL'} {name}")
    print(json.dumps(summary, indent=1, default=str)[:6000])
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
