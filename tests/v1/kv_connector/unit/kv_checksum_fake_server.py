# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A fake `vllm serve` for CPU dry runs of the chaos driver and its tests.

Run as ``python kv_checksum_fake_server.py serve MODEL --port N ...`` (other
arguments ignored). Serves /health, /metrics, /v1/completions and
/v1/chat/completions (plain and streamed) with kv_transfer_params; the answer
depends only on the prompt, so a P/D answer equals a local one. Its
``kv_checksums`` are a self-checked digest of the prompt; a consumer with
checksums on gives verified, mismatch (another prompt's) or unverified (none,
or unreadable) and logs them as the package does.
``python kv_checksum_fake_server.py router --prefill URL --decode URL --port N``
plays vllm-router's P/D flow (prefill, then decode with its kv_transfer_params).
Environment:
  FAKE_TRACKED_GAUGE=1  expose vllm:kv_checksum_tracked_requests (requests in
                        flight, so it returns to 0 once idle)
The injector of its --kv-transfer-config (rate r) fakes a fault every round(1/r)-th
load: an injection line and its mismatch line in the log, as the package logs them.
  FAKE_DELAY_MS=T       sleep T ms before answering (an in-flight window)
  FAKE_WRONG_LOADS=N,M  the consumer's N-th, M-th... loads answer a wrong text
Ids as vLLM's: the response id is cmpl-<X-Request-Id> (chat: chatcmpl-), log
lines name the engine id (cmpl-<X-Request-Id>-0-<8 hex>).
With kv_checksum_verify_prefix_hits in its config, every completion counts one
verified vllm:kv_checksum_prefix_hits_total. With an OffloadingConnector in it
(alone or a MultiConnector child), every completion is one host load: vLLM's
vllm:kv_offload_load_* counters grow (1 MiB each) and, with checksums on, one
verified vllm:kv_checksum_loads_total. A SimpleCPUOffloadConnector without the
prefix-hit flag does the same with vllm:simple_kv_offload_load_blocks_total
(one block a load). A LMCacheConnectorV1 does the same with vLLM's
vllm:external_prefix_cache_hits_total (256 tokens a load) and, with checksums
on, one verified vllm:kv_checksum_external_loads_total.
``python kv_checksum_fake_server.py bench serve --base-url URL --num-prompts N
--result-dir D --result-filename F ...`` is a fake `vllm bench serve`: N
completions one at a time, then a result file with fixed timings (10 req/s,
TTFT 20 ms, TPOT 5 ms).
"""

import base64
import hashlib
import http.client
import json
import os
import sys
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {
    "tracked": 0,
    "loads": 0,
    "verified": 0,
    "mismatch": 0,
    "unverified": 0,
    "hits": 0,
    "host_loads": 0,
    "external_verified": 0,
}
REASONS = {
    "no_checksums": "the producer sent no checksums",
    "invalid_checksums": "the producer's checksums are invalid",
}
UNVERIFIED = dict.fromkeys(REASONS, 0)
WARNED: set[str] = set()
CHECKSUMS = True
UPSTREAMS: dict[str, str] = {}
TRACKED = os.environ.get("FAKE_TRACKED_GAUGE") == "1"
FAULT_EVERY = 0
VERIFY_HITS = False
OFFLOAD = ""  # the connector whose host loads are faked
LMCACHE = "LMCacheConnectorV1"
DELAY_S = float(os.environ.get("FAKE_DELAY_MS", "0")) / 1000
WRONG_LOADS = {int(n) for n in os.environ.get("FAKE_WRONG_LOADS", "").split(",") if n}


def words(prompt: str, count: int) -> list[str]:
    """The fake model: token i of the answer from the prompt's CRC."""
    seed = zlib.crc32(prompt.encode())
    return [f" t{(seed + 7 * i) % 1000 + 4}" for i in range(count)]


def prompt_of(body: dict) -> str:
    messages = body.get("messages") or []
    return body.get("prompt") or "".join(m.get("content", "") for m in messages)


def checksums(prompt: str) -> str:
    """The fake payload: 16 bytes of the prompt's digest and 8 of their own."""
    digest = hashlib.sha256(prompt.encode()).digest()[:16]
    return base64.b64encode(digest + hashlib.sha256(digest).digest()[:8]).decode()


def metrics() -> bytes:
    # vLLM's finished-request counter (the chaos driver times kills by it).
    answered = f'vllm:request_success_total{{engine="0"}} {float(STATE["hits"])}\n'
    host = float(STATE["host_loads"])
    if OFFLOAD == "OffloadingConnector":  # vLLM's counters, checksums or not
        answered += f'vllm:kv_offload_load_bytes_total{{engine="0"}} {host * 2**20}\n'
        answered += f'vllm:kv_offload_load_size_count{{engine="0"}} {host}\n'
    elif OFFLOAD == LMCACHE:
        tokens = host * 256
        answered += f'vllm:external_prefix_cache_hits_total{{engine="0"}} {tokens}\n'
    elif OFFLOAD:
        answered += f'vllm:simple_kv_offload_load_blocks_total{{engine="0"}} {host}\n'
    if not CHECKSUMS:
        return ("vllm:other 1.0\n" + answered).encode()
    lines = [answered.strip()] + [
        f'vllm:kv_checksum_loads_total{{engine="0",verdict="{v}"}} {float(STATE[v])}'
        for v in ("verified", "mismatch", "unverified")
    ]
    lines += [
        f'vllm:kv_checksum_unverified_loads_total{{engine="0",reason="{r}"}} {n}.0'
        for r, n in UNVERIFIED.items()
    ]
    if OFFLOAD == LMCACHE:
        external = "vllm:kv_checksum_external_loads_total"
        verified = float(STATE["external_verified"])
        lines.append(f'{external}{{engine="0",verdict="verified"}} {verified}')
        lines.append(f'{external}{{engine="0",verdict="mismatch"}} 0.0')
    if VERIFY_HITS:
        hits = "vllm:kv_checksum_prefix_hits_total"
        lines.append(f'{hits}{{engine="0",verdict="verified"}} {float(STATE["hits"])}')
        lines.append(f'{hits}{{engine="0",verdict="mismatch"}} 0.0')
    if TRACKED:
        lines.append(
            f'vllm:kv_checksum_tracked_requests{{engine="0"}} {float(STATE["tracked"])}'
        )
    return ("\n".join(lines) + "\n").encode()


def load(body: dict, rid: str) -> bool:
    """A consumer request with remote prefill: count its verdict, log faults;
    True when this load is one FAKE_WRONG_LOADS answers wrong."""
    params = body.get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill") or not CHECKSUMS:
        return False
    verdict, reason = judge(params.get("kv_checksums"), prompt_of(body))
    with LOCK:
        STATE["loads"] += 1
        wrong = STATE["loads"] in WRONG_LOADS
        fault = FAULT_EVERY and STATE["loads"] % FAULT_EVERY == 0
        verdict = "mismatch" if fault else verdict
        STATE[verdict] += 1
        if verdict == "unverified":
            UNVERIFIED[reason] += 1
            first = reason not in WARNED
            WARNED.add(reason)
    if verdict == "unverified" and first:
        print(f"WARNING KV checksums not verified: {REASONS[reason]}.", flush=True)
    if verdict == "mismatch" and not fault:
        print(f"ERROR KV checksum mismatch for request {rid}: [0]", flush=True)
    if fault:
        print(
            f"WARNING KV checksum fault injection: bitflip into request {rid} group 0",
            flush=True,
        )
        print(
            f"ERROR [verdict_log.py:64] KV checksum mismatch for request {rid}: [0]",
            flush=True,
        )
    return wrong


def judge(value: object, prompt: str) -> tuple[str, str]:
    """verified, mismatch or unverified (and its reason label)."""
    if value is None:
        return "unverified", "no_checksums"
    try:
        raw = base64.b64decode(str(value), validate=True)
    except ValueError:
        return "unverified", "invalid_checksums"
    if len(raw) != 24 or hashlib.sha256(raw[:16]).digest()[:8] != raw[16:]:
        return "unverified", "invalid_checksums"
    return ("verified" if value == checksums(prompt) else "mismatch"), ""


def post(url: str, body: dict, path: str, rid: str) -> tuple[int, bytes, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"X-Request-Id": rid})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def send(self, data: bytes, kind: str, status: int = 200) -> None:
        self.send_response(status)
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
        if UPSTREAMS:
            self.route(body)
            return
        if ("messages" in body) != self.path.endswith("/chat/completions"):
            self.send(b'{"error": "wrong endpoint"}', "application/json", 400)
            return
        rid = self.headers.get("X-Request-Id") or str(time.monotonic_ns())
        cid = ("chatcmpl-" if "messages" in body else "cmpl-") + rid
        engine_id = cid + ("" if "messages" in body else "-0")
        with LOCK:
            STATE["tracked"] += 1
        try:
            time.sleep(DELAY_S)
            wrong = load(body, f"{engine_id}-{uuid.uuid4().hex[:8]}")
            with LOCK:
                STATE["hits"] += 1
                if OFFLOAD:
                    STATE["host_loads"] += 1
                    verdict = "external_verified" if OFFLOAD == LMCACHE else "verified"
                    STATE[verdict] += CHECKSUMS
            self.answer(body, cid, wrong)
        except OSError:
            pass  # the client went away
        finally:
            with LOCK:
                STATE["tracked"] -= 1

    def route(self, body: dict) -> None:
        """vllm-router's P/D flow: prefill, then decode with its params."""
        prefill = dict(body, max_tokens=1, stream=False)
        prefill["kv_transfer_params"] = {"do_remote_decode": True}
        rid = f"fake-router-{time.monotonic_ns()}"
        status, data, kind = post(UPSTREAMS["prefill"], prefill, self.path, rid)
        if status == 200:
            params = json.loads(data).get("kv_transfer_params")
            decode = dict(body, kv_transfer_params=params)
            status, data, kind = post(UPSTREAMS["decode"], decode, self.path, rid)
        self.send(data, kind, status)

    def answer(self, body: dict, cid: str, wrong: bool) -> None:
        count = body.get("max_tokens", 1)
        tokens = words(prompt_of(body) + (" wrong" if wrong else ""), count)
        chat = "messages" in body
        if not body.get("stream"):
            text = "".join(tokens)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": text}}
                if chat
                else {"text": text}
            )
            out = {
                "id": cid,
                "object": "text_completion",
                "model": "tiny",
                "choices": [choice],
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_engine_id": "fake",
                    "kv_checksums": checksums(prompt_of(body)),
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
            choice = {"index": 0, "finish_reason": done}
            choice.update({"delta": {"content": token}} if chat else {"text": token})
            self.chunk("data: " + json.dumps({"id": cid, "choices": [choice]}) + "\n\n")
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
    global FAULT_EVERY, VERIFY_HITS, CHECKSUMS, OFFLOAD
    args = sys.argv[1:]
    if args[:2] == ["bench", "serve"]:
        bench(args[2:])
        return
    port = int(args[args.index("--port") + 1])
    if args[0] == "router":
        UPSTREAMS["prefill"] = args[args.index("--prefill") + 1]
        UPSTREAMS["decode"] = args[args.index("--decode") + 1]
    if "--kv-transfer-config" in args:
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        extra = config.get("kv_connector_extra_config", {})
        CHECKSUMS = bool(extra.get("enable_kv_checksum"))
        rate = extra.get("kv_checksum_fault_injection", {}).get("rate", 0)
        FAULT_EVERY = round(1 / rate) if rate else 0
        VERIFY_HITS = extra.get("kv_checksum_verify_prefix_hits") is True
        children = [config, *extra.get("connectors", [])]
        names = {c.get("kv_connector") for c in children}
        if "OffloadingConnector" in names:
            OFFLOAD = "OffloadingConnector"
        elif LMCACHE in names:
            OFFLOAD = LMCACHE
        elif "SimpleCPUOffloadConnector" in names and not VERIFY_HITS:
            OFFLOAD = "SimpleCPUOffloadConnector"
    print("fake serve", args, flush=True)
    Server(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
