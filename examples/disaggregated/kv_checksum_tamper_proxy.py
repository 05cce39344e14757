# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A proxy between vllm-router and a P/D producer that alters the
``kv_checksums`` of the producer's ``kv_transfer_params`` (issue 26 item 5).

Every request goes to the producer unchanged (health checks, /v1/models and
streamed answers pass through); a JSON answer's ``kv_checksums`` is rewritten
by the current mode: ``none`` (kept), ``drop`` (key removed), ``truncate``
(the first half kept), ``other`` (an earlier, different request's value),
``garbage`` (random base64 of the same length).

    python kv_checksum_tamper_proxy.py --port 8600 --upstream http://127.0.0.1:8100

``POST /_tamper {"mode": "drop"}`` sets the mode; ``GET /_tamper`` returns the
mode and the rewrites per mode.
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODES = ("none", "drop", "truncate", "other", "garbage")
KEY = "kv_checksums"
# Hop-by-hop headers the proxy sets itself.
_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def prompt_key(request: dict[str, Any]) -> str:
    """The text a request prefills: its prompt or its messages' contents."""
    prompt = request.get("prompt")
    if prompt is not None:
        return json.dumps(prompt)
    messages = request.get("messages") or []
    return json.dumps(
        "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    )


class Tamperer:
    """The rewriting of one proxy: its mode, the values it saw and its counts."""

    def __init__(self, seed: int = 0, history: int = 64) -> None:
        self.mode = "none"
        self.counts = dict.fromkeys(MODES, 0)
        self.seen: collections.deque[tuple[str, Any]] = collections.deque(
            maxlen=history
        )
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        with self.lock:
            self.mode = mode

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"mode": self.mode, "counts": dict(self.counts)}

    def rewrite(self, request: dict[str, Any], reply: Any) -> Any:
        """`reply` with its kv_checksums altered by the mode (in place) and
        counted under it; a reply without them, or an `other` with no earlier
        different request, is returned as is and not counted."""
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict) or KEY not in params:
            return reply
        key, value = prompt_key(request), params[KEY]
        with self.lock:
            mode = self.mode
            other = next((v for k, v in reversed(self.seen) if k != key), None)
            self.seen.append((key, value))
            if mode == "none":
                pass
            elif mode == "drop":
                del params[KEY]
            elif mode == "truncate" and isinstance(value, (str, list)):
                params[KEY] = value[: len(value) // 2]
            elif mode == "other" and other is not None:
                params[KEY] = other
            elif mode == "garbage" and isinstance(value, str):
                params[KEY] = self._garbage(len(value))
            else:
                return reply
            self.counts[mode] += 1
        return reply

    def _garbage(self, length: int) -> str:
        """Random padded base64 of `length` characters (a multiple of 4)."""
        raw = self.rng.randbytes(length // 4 * 3)
        return base64.b64encode(raw).decode("ascii")[:length]


def make_handler(upstream: str, tamperer: Tamperer) -> type[BaseHTTPRequestHandler]:
    host, port = upstream.removeprefix("http://").rstrip("/").split(":")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def reply(self, status: int, headers: list[tuple[str, str]], data: bytes):
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def control(self, data: bytes) -> None:
            try:
                if self.command == "POST":
                    tamperer.set_mode(json.loads(data)["mode"])
                out, status = tamperer.state(), 200
            except (ValueError, KeyError, TypeError) as e:
                out, status = {"error": str(e)}, 400
            self.reply(status, [("Content-Type", "application/json")], _dump(out))

        def forward(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(size) if size else b""
            if self.path == "/_tamper":
                self.control(data)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            try:
                conn.request(self.command, self.path, data or None, headers)
                resp = conn.getresponse()
                out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
                if resp.getheader("Content-Length") is None:
                    self.stream(resp, out)
                    return
                answer = resp.read()
                if "json" in (resp.getheader("Content-Type") or "") and data:
                    answer = self.tampered(data, answer)
                self.reply(resp.status, out, answer)
            except (OSError, http.client.HTTPException) as e:
                self.reply(502, [("Content-Type", "text/plain")], repr(e).encode())
            finally:
                conn.close()

        def tampered(self, request: bytes, answer: bytes) -> bytes:
            try:
                body, reply = json.loads(request), json.loads(answer)
            except ValueError:
                return answer
            if not isinstance(body, dict):
                return answer
            return _dump(tamperer.rewrite(body, reply))

        def stream(self, resp: http.client.HTTPResponse, headers: list) -> None:
            """A streamed answer passed through chunk by chunk, unaltered."""
            self.send_response(resp.status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while piece := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        do_GET = do_POST = do_PUT = do_DELETE = forward

    return Handler


def _dump(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the producer's URL")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    handler = make_handler(args.upstream, Tamperer(args.seed))
    print(f"tamper proxy :{args.port} -> {args.upstream}", flush=True)
    Server(("127.0.0.1", args.port), handler).serve_forever()


if __name__ == "__main__":
    main()
