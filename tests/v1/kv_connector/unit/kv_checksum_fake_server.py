# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A fake `vllm serve` for CPU dry runs of the chaos driver and its tests.

Run as ``python kv_checksum_fake_server.py serve MODEL --port N ...`` (other
arguments ignored). Serves /health, /metrics and /v1/completions (plain and
streamed) with kv_transfer_params; the answer depends only on the prompt, so a
P/D answer equals a local one. Environment:
  FAKE_TRACKED_GAUGE=1  expose vllm:kv_checksum_tracked_requests (requests in
                        flight, so it returns to 0 once idle)
The injector of its --kv-transfer-config (rate r) fakes a fault every round(1/r)-th
load: an injection line and its mismatch line in the log, as the package logs them.
  FAKE_DELAY_MS=T       sleep T ms before answering (an in-flight window)
With kv_checksum_verify_prefix_hits in its config, every completion counts one
verified vllm:kv_checksum_prefix_hits_total. ``python kv_checksum_fake_server.py
bench serve --base-url URL --num-prompts N --result-dir D --result-filename F ...``
is a fake `vllm bench serve`: N completions one at a time, then a result file
with fixed timings (10 req/s, TTFT 20 ms, TPOT 5 ms).
"""

import json
import os
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"tracked": 0, "loads": 0, "verified": 0, "mismatch": 0, "hits": 0}
TRACKED = os.environ.get("FAKE_TRACKED_GAUGE") == "1"
FAULT_EVERY = 0
VERIFY_HITS = False
DELAY_S = float(os.environ.get("FAKE_DELAY_MS", "0")) / 1000


def words(prompt: str, count: int) -> list[str]:
    """The fake model: token i of the answer from the prompt's CRC."""
    seed = zlib.crc32(prompt.encode())
    return [f" t{(seed + 7 * i) % 1000 + 4}" for i in range(count)]


def metrics() -> bytes:
    lines = [
        f'vllm:kv_checksum_loads_total{{engine="0",verdict="{v}"}} {float(STATE[v])}'
        for v in ("verified", "mismatch")
    ]
    if VERIFY_HITS:
        hits = "vllm:kv_checksum_prefix_hits_total"
        lines.append(f'{hits}{{engine="0",verdict="verified"}} {float(STATE["hits"])}')
        lines.append(f'{hits}{{engine="0",verdict="mismatch"}} 0.0')
    if TRACKED:
        lines.append(
            f'vllm:kv_checksum_tracked_requests{{engine="0"}} {float(STATE["tracked"])}'
        )
    return ("\n".join(lines) + "\n").encode()


def load(body: dict, rid: str) -> None:
    """A consumer request with remote prefill: count its verdict, log faults."""
    params = body.get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill"):
        return
    with LOCK:
        STATE["loads"] += 1
        fault = FAULT_EVERY and STATE["loads"] % FAULT_EVERY == 0
        STATE["mismatch" if fault else "verified"] += 1
    if fault:
        print(
            f"WARNING KV checksum fault injection: bitflip into request {rid} group 0",
            flush=True,
        )
        print(
            f"ERROR [verdict_log.py:64] KV checksum mismatch for request {rid}: [0]",
            flush=True,
        )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def send(self, data: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.send(metrics() if self.path == "/metrics" else b"ok", "text/plain")

    def chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(size))
        rid = self.headers.get("X-Request-Id") or f"cmpl-{time.monotonic_ns()}"
        with LOCK:
            STATE["tracked"] += 1
        try:
            time.sleep(DELAY_S)
            load(body, rid)
            with LOCK:
                STATE["hits"] += 1
            self.answer(body)
        except OSError:
            pass  # the client went away
        finally:
            with LOCK:
                STATE["tracked"] -= 1

    def answer(self, body: dict) -> None:
        count = body.get("max_tokens", 1)
        tokens = words(body.get("prompt", ""), count)
        if not body.get("stream"):
            out = {
                "id": "x",
                "object": "text_completion",
                "model": "tiny",
                "choices": [
                    {"index": 0, "text": "".join(tokens), "finish_reason": "length"}
                ],
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_engine_id": "fake",
                    "kv_checksums": "abc",
                },
            }
            self.send(json.dumps(out).encode(), "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, token in enumerate(tokens):
            time.sleep(0.002)
            done = "length" if i == count - 1 else None
            choice = {"index": 0, "text": token, "finish_reason": done}
            self.chunk("data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n")
        self.chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # 64 clients connect at once
    daemon_threads = True


def bench(args: list[str]) -> None:
    """A fake `vllm bench serve`: the completions, then a fixed result file."""
    import urllib.request

    def arg(name: str) -> str:
        return args[args.index(name) + 1]

    print("fake bench", args, flush=True)
    count = int(arg("--num-prompts"))
    for i in range(count):
        body = {"model": "model", "prompt": f"s{arg('--seed')} p{i}", "max_tokens": 2}
        request = urllib.request.Request(
            arg("--base-url") + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
    result = {
        "completed": count,
        "failed": 0,
        "duration": count / 10.0,
        "request_throughput": 10.0,
        "median_ttft_ms": 20.0,
        "median_tpot_ms": 5.0,
        "ttfts": [0.02] * count,
        "errors": [""] * count,
    }
    path = os.path.join(arg("--result-dir"), arg("--result-filename"))
    with open(path, "w") as out:
        json.dump(result, out)


def main() -> None:
    global FAULT_EVERY, VERIFY_HITS
    args = sys.argv[1:]
    if args[:2] == ["bench", "serve"]:
        bench(args[2:])
        return
    port = int(args[args.index("--port") + 1])
    if "--kv-transfer-config" in args:
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        extra = config.get("kv_connector_extra_config", {})
        rate = extra.get("kv_checksum_fault_injection", {}).get("rate", 0)
        FAULT_EVERY = round(1 / rate) if rate else 0
        VERIFY_HITS = extra.get("kv_checksum_verify_prefix_hits") is True
    print("fake serve", args, flush=True)
    Server(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
