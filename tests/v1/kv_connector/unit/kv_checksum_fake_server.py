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
"""

import json
import os
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"tracked": 0, "loads": 0, "verified": 0, "mismatch": 0}
TRACKED = os.environ.get("FAKE_TRACKED_GAUGE") == "1"
FAULT_EVERY = 0
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


def main() -> None:
    global FAULT_EVERY
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if "--kv-transfer-config" in args:
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        extra = config.get("kv_connector_extra_config", {})
        rate = extra.get("kv_checksum_fault_injection", {}).get("rate", 0)
        FAULT_EVERY = round(1 / rate) if rate else 0
    print("fake serve", args, flush=True)
    Server(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
