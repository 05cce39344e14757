# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Faults of processes and time on a `vllm serve` P/D pair behind vllm-router
(issue 27): producer SIGKILL, client aborts, consumer restart, lease expiry at
concurrency 32, and a soak, checksums on.

The servers are those of ``kv_checksum_router_pd.sh`` (NIXL pull, producer
:8100, consumer :8200 fail-closed + recompute, vllm-router :8000), started one
by one here because a chaos run kills and restarts them (the script ends all
three when one exits). producer_kill adds a fail-policy consumer behind a second
router (:8001); lease_expiry a producer with a short lease and a small KV cache.

Scenarios (``--scenarios``, each ``--repeats`` times):
  producer_kill    SIGKILL the producer while requests load from it, restart it
  client_abort     clients close streams before/during the load, before the
                   verification, during decode; tracked-request gauges back to 0
  consumer_restart SIGKILL and restart the consumer while the producer holds
                   leases for it; new requests verify; the producer's gauge 0
                   after the lease
  lease_expiry     the stale-read incident at concurrency 32: every stale load
                   reported, every answer right
  soak             --soak-requests at concurrency 64, 5 % aborts, injector 0.01
  tamper           a proxy before the producer (kv_checksum_tamper_proxy.py)
                   drops, truncates, swaps or garbles kv_checksums behind a
                   router (:8002); per mode completions and chat requests one
                   at a time and at once: every answer right, the consumer's
                   verdicts and reasons as the guide says; a checksums-off
                   consumer (router :8003) gives the same HTTP statuses
A right answer equals the reference of its prompt: the consumer's own
computation without a KV load (no checksum code on its path) or the pre-chaos
P/D answer (batch-invariant kernels make both deterministic). An alternate
answer is another text of its prompt measured before any fault, with no
injector on, while local multi-token prefills share the consumer's batch
(``--mixed-repeats``): batch invariance does not hold there, and near-tie
prompts take a second deterministic continuation (what a recompute beside a
load gives). Alternates are counted apart, neither right nor wrong; every
"no wrong answer" check counts wrong ones only.

    python examples/disaggregated/kv_checksum_chaos.py --out /tmp/chaos \\
        --scenarios producer_kill,client_abort,consumer_restart,lease_expiry

Writes OUT/summary.json (per scenario: pass, counts, checks; soak: memory and
gauge samples) and the servers' logs under OUT; exits 0 when all passed.
Pure logic lives in ``kv_checksum_chaos_plan.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import http.client
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import kv_checksum_chaos_plan as plan  # noqa: E402
from benchmark_kv_checksum_serve import http_get  # noqa: E402
from kv_checksum_chaos_plan import AbortPlan, Outcome, ServerSpec  # noqa: E402
from kv_checksum_serve_pd import EXPIRED_READ, serve_env  # noqa: E402

# vLLM's finished-request counter: a producer's answered prefills.
ANSWERED = "vllm:request_success_total"
CLI = f"{sys.executable} -m vllm.entrypoints.cli.main"
ROUTER = f"{sys.executable} -m vllm_router.launch_router"
PROXY = HERE / "kv_checksum_tamper_proxy.py"
# The tiny model has no chat template: the messages' contents, as one prompt.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
UNVERIFIED = "vllm:kv_checksum_unverified_loads_total"
T0 = time.monotonic()  # the driver's start: outcomes' send and finish times
# The mixed references: local long prefills in flight at once on the
# consumer, and the router requests sent at once meanwhile.
MIXED_FILLERS = 4
MIXED_CONCURRENCY = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Proc:
    """One server or router process in its own session (so a SIGKILL of its
    group ends its engine core too); its log appends across restarts."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], port: int, out: Path
    ):
        self.name, self.cmd, self.env, self.port = name, cmd, env, port
        self.log_path = out / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== start {self.starts}: {shlex.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.starts += 1

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if http_get(self.url + "/health", timeout=2) is not None:
                return True
            time.sleep(0.5)
        return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what SIGTERM left

    def pids(self) -> list[int]:
        """The process and its children (API server, engine core, workers)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            import psutil

            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except Exception:
            return [self.proc.pid]

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics(self) -> str | None:
        return http_get(self.url + "/metrics", timeout=10)

    def log_mark(self) -> int:
        return self.log_text().count("\n")

    def lines_since(self, mark: int) -> str:
        return "\n".join(self.log_text().splitlines()[mark:])


def server_proc(spec: ServerSpec, args: argparse.Namespace) -> Proc:
    cmd = [*shlex.split(args.serve_cmd), "serve", args.model]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1"]
    cmd += ["--port", str(spec.port), "--gpu-memory-utilization", str(args.gpu_util)]
    cmd += ["--max-model-len", str(args.max_model_len), "--block-size", "16"]
    cmd += ["--kv-cache-memory-bytes", str(1 << 30)]
    if spec.num_blocks:
        cmd += ["--num-gpu-blocks-override", str(spec.num_blocks)]
    cmd += ["--dtype", "bfloat16", "--seed", "0", "--enforce-eager"]
    cmd += ["--chat-template", CHAT_TEMPLATE]
    config = plan.kv_transfer_config(spec, args.connector)
    cmd += ["--kv-transfer-config", json.dumps(config)]
    env = serve_env(spec.side_port)
    # Concurrent batches must not change outputs: answers are compared.
    env["VLLM_BATCH_INVARIANT"] = "1"
    return Proc(spec.name, cmd, env, spec.port, args.out)


def router_proc(
    spec: plan.RouterSpec, ports: dict[str, int], args: argparse.Namespace
) -> Proc:
    cmd = [*shlex.split(args.router_cmd), "--vllm-pd-disaggregation"]
    cmd += ["--kv-connector", "nixl", "--policy", "round_robin"]
    cmd += ["--prefill", f"http://127.0.0.1:{ports[spec.producer]}"]
    cmd += ["--decode", f"http://127.0.0.1:{ports[spec.consumer]}"]
    cmd += ["--host", "127.0.0.1", "--port", str(spec.port)]
    cmd += ["--prometheus-port", str(spec.prom_port)]
    return Proc(spec.name, cmd, dict(os.environ), spec.port, args.out)


def proxy_proc(spec: plan.ProxySpec, ports: dict[str, int], out: Path) -> Proc:
    upstream = f"http://127.0.0.1:{ports[spec.upstream]}"
    cmd = [sys.executable, str(PROXY), "--port", str(spec.port)]
    cmd += ["--upstream", upstream]
    return Proc(spec.name, cmd, dict(os.environ), spec.port, out)


def body(
    prompt: str, args: argparse.Namespace, stream: bool = True, chat: bool = False
) -> dict[str, Any]:
    """A client's greedy request (chat: the prompt as one user message); a
    unique cache salt keeps it off prefix caches."""
    out: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "cache_salt": uuid.uuid4().hex,
    }
    if chat:
        out["messages"] = [{"role": "user", "content": out.pop("prompt")}]
    return out


def choice_text(choice: dict[str, Any]) -> str:
    """A completion choice's text, a chat choice's message or delta content."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


def complete(
    url: str,
    payload: dict[str, Any],
    timeout: float,
    abort: AbortPlan | None = None,
    prompt: int = 0,
    request_id: str | None = None,
) -> Outcome:
    """POST /v1/completions (/v1/chat/completions for a body with
    messages); a streamed answer is read chunk by chunk and the
    connection closed where `abort` says (time or chunk count)."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    stop_at = (
        t0 + abort.after_ms / 1000 if abort and abort.after_ms is not None else None
    )
    end_at = t0 + timeout
    outcome = Outcome(status=0, prompt=prompt, phase=abort.phase if abort else "")
    outcome.sent_s = round(t0 - T0, 3)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def budget() -> float:
        limit = min(end_at, stop_at) if stop_at else end_at
        return max(0.001, limit - time.monotonic())

    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(budget())
        headers = {"Content-Type": "application/json"}
        if request_id:
            headers["X-Request-Id"] = request_id
        path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
        conn.request("POST", path, json.dumps(payload), headers)
        response = conn.getresponse()
        outcome.status = response.status
        if response.status != 200:
            outcome.error = response.read().decode(errors="replace")[:300]
            return outcome
        if not payload.get("stream"):
            reply = json.loads(response.read())
            if reply.get("error") or not reply.get("choices"):
                outcome.error = json.dumps(reply.get("error"))[:300]
                return outcome
            outcome.request_id = str(reply.get("id", ""))
            outcome.text = choice_text(reply["choices"][0])
            return outcome
        chunks, pieces, done = 0, [], False
        while not done:
            conn.sock.settimeout(budget())
            line = response.readline()
            if not line:
                break
            line = line.strip()
            done = line == b"data: [DONE]"
            if not line.startswith(b"data: ") or done:
                continue
            data = json.loads(line[6:])
            if data.get("error"):
                # vLLM streams a failed request (e.g. kv_load_failure_policy
                # "fail") as an error event and [DONE] after its HTTP 200.
                outcome.error = json.dumps(data["error"])[:300]
                continue
            outcome.request_id = outcome.request_id or str(data.get("id", ""))
            choices = data.get("choices") or []
            if choices:
                chunks += 1
                pieces.append(choice_text(choices[0]))
            if (
                abort
                and abort.after_chunks is not None
                and chunks >= abort.after_chunks
            ):
                outcome.aborted = True
                return outcome
        if outcome.error:
            pass  # an error event: no answer (classified as an error)
        elif done:
            outcome.text = "".join(pieces)
        else:  # a stream cut short (a server died) is no answer
            outcome.error = f"stream ended after {chunks} chunks without [DONE]"
    except TimeoutError:
        if stop_at is not None and time.monotonic() >= stop_at - 0.001:
            outcome.aborted = True
        else:
            outcome.hung = True
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        outcome.error = repr(e)[:300]
    finally:
        conn.close()
        outcome.elapsed_s = round(time.monotonic() - t0, 3)
        outcome.finished_s = round(outcome.sent_s + outcome.elapsed_s, 3)
    return outcome


def make_prompts(count: int, seed: int, lo: int = 24, hi: int = 200) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(f"t{rng.randrange(4, 1024)}" for _ in range(rng.randint(lo, hi)))
        for _ in range(count)
    ]


class Run:
    """The processes of one chaos run and the helpers its scenarios share."""

    def __init__(self, args: argparse.Namespace, topology: plan.Topology):
        self.args, self.topology = args, topology
        ports = {s.name: s.port for s in [*topology.servers, *topology.proxies]}
        self.procs = {s.name: server_proc(s, args) for s in topology.servers}
        self.procs.update(
            {p.name: proxy_proc(p, ports, args.out) for p in topology.proxies}
        )
        self.procs.update(
            {r.name: router_proc(r, ports, args) for r in topology.routers}
        )
        self.prompts = make_prompts(args.num_prompts, seed=11)
        self.references: list[set[str]] = [set() for _ in self.prompts]
        # Per prompt, the texts of `mixed_references` (the second regime).
        self.alternates: list[set[str]] = [set() for _ in self.prompts]
        self.ttft_ms = 200.0
        self.samples: list[dict[str, Any]] = []

    def start_all(self) -> None:
        servers = [self.procs[s.name] for s in self.topology.servers]
        for proc in servers:
            proc.start()
        for proc in servers:
            if not proc.wait_healthy(self.args.startup_timeout):
                raise RuntimeError(f"{proc.name} did not start; see {proc.log_path}")
        for spec in self.topology.proxies:
            self.procs[spec.name].start()
            if not self.procs[spec.name].wait_healthy(self.args.startup_timeout):
                raise RuntimeError(f"{spec.name} did not start")
        for router in self.topology.routers:
            self.procs[router.name].start()
            if not self.procs[router.name].wait_healthy(self.args.startup_timeout):
                raise RuntimeError(f"{router.name} did not start")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill(signal.SIGTERM)

    def restart(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Kill `name`'s group with `sig`, start it again; seconds until healthy."""
        proc = self.procs[name]
        proc.kill(sig)
        t0 = time.time()
        proc.start()
        if not proc.wait_healthy(self.args.startup_timeout):
            raise RuntimeError(f"{name} did not restart; see {proc.log_path}")
        return round(time.time() - t0, 1)

    def router_url(self, name: str = "router") -> str:
        return self.procs[name].url

    def verdict(self, name: str, key: str = "verified") -> float:
        from benchmark_kv_checksum_serve import verdict_counts

        return verdict_counts(self.procs[name].metrics()).get(key, 0.0)

    def gauge(self, name: str) -> float | None:
        return plan.gauge_total(self.procs[name].metrics())

    def wait_answered(self, name: str, count: float, timeout: float) -> float:
        """Poll `name`'s finished-request counter until it reaches `count` (or
        timeout); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            done = plan.gauge_total(self.procs[name].metrics(), ANSWERED) or 0.0
            if done >= count:
                break
            time.sleep(0.002)
        return round(time.monotonic() - t0, 3)

    def wait_gauge_zero(self, name: str, timeout: float) -> float | None:
        """Poll `name`'s tracked-request gauge until 0 (or n/a, or timeout)."""
        deadline = time.time() + timeout
        value = self.gauge(name)
        while value and time.time() < deadline:
            time.sleep(1.0)
            value = self.gauge(name)
        return value

    def references_from(self, consumer: str) -> None:
        """Each prompt computed locally by `consumer` and once through the
        router before any fault: the acceptable answers. Then the median time
        of a one-token P/D request: the TTFT the abort and kill times scale."""
        proc = self.procs[consumer]
        for i, prompt in enumerate(self.prompts):
            for url in (proc.url, self.router_url()):
                out = complete(url, body(prompt, self.args), self.args.timeout)
                if out.text is not None:
                    self.references[i].add(out.text)
        times = []
        for prompt in self.prompts[:8]:
            payload = dict(body(prompt, self.args), max_tokens=1)
            out = complete(self.router_url(), payload, self.args.timeout)
            times.append(out.elapsed_s * 1000)
        self.ttft_ms = max(1.0, statistics.median(times))
        answers = sum(map(len, self.references))
        log(f"references: {answers} answers; one-token P/D {self.ttft_ms:.0f} ms")

    def mixed_references(self, consumer: str) -> None:
        """Before any fault (no injector on): every prompt --mixed-repeats
        times through the router while MIXED_FILLERS threads keep `consumer`
        busy with local 1,000-1,500-token prefills (max_tokens 1); each
        answered text that is no reference is an alternate of its prompt.
        Such prefills in the consumer's batch are what a recompute does, so
        this measures the answers that regime gives without any fault."""
        args, proc = self.args, self.procs[consumer]
        repeats = args.mixed_repeats
        if repeats <= 0:
            log("mixed references: off (--mixed-repeats 0)")
            return
        hi = min(1500, args.max_model_len - 16)
        fillers = make_prompts(64, seed=6, lo=min(1000, hi), hi=hi)
        stop = threading.Event()

        def busy(k: int) -> list[int]:
            """Local prefills one after another until `stop`; their statuses."""
            statuses: list[int] = []
            n = k
            while not stop.is_set():
                payload = body(fillers[n % len(fillers)], args, stream=False)
                payload["max_tokens"] = 1
                statuses.append(complete(proc.url, payload, args.timeout).status)
                n += MIXED_FILLERS
            return statuses

        jobs = [p for _ in range(repeats) for p in range(len(self.prompts))]

        def one(p: int) -> Outcome:
            return complete(
                self.router_url(), body(self.prompts[p], args), args.timeout, None, p
            )

        with cf.ThreadPoolExecutor(max_workers=MIXED_FILLERS) as background:
            busy_runs = [background.submit(busy, k) for k in range(MIXED_FILLERS)]
            try:
                with cf.ThreadPoolExecutor(max_workers=MIXED_CONCURRENCY) as pool:
                    outcomes = list(pool.map(one, jobs))
            finally:
                stop.set()
            statuses = [s for run in busy_runs for s in run.result()]
        self.alternates = plan.collect_alternates(outcomes, self.references)
        found = {
            p: sorted(plan.first_divergence(t, self.references[p]) for t in texts)
            for p, texts in enumerate(self.alternates)
            if texts
        }
        counts = plan.tally(outcomes, self.references, self.alternates)
        log(
            f"mixed references: {len(found)} of {len(self.prompts)} prompts got "
            f"alternates (prompt: divergence word per alternate {found}); "
            f"{counts}; local prefills {len(statuses)}, "
            f"{statuses.count(200)} answered"
        )

    def fire(
        self,
        url: str,
        count: int,
        concurrency: int,
        aborts: list[AbortPlan | None] | None = None,
        seed: int = 0,
        chat: bool = False,
    ) -> cf.Future:
        """`count` requests (random prompts) in the background; the future
        gives their outcomes."""
        rng = random.Random(seed)
        picks = [rng.randrange(len(self.prompts)) for _ in range(count)]
        plans = aborts or [None] * count

        def one(i: int) -> Outcome:
            p = picks[i]
            payload = body(self.prompts[p], self.args, chat=chat)
            return complete(url, payload, self.args.timeout, plans[i], p)

        pool = cf.ThreadPoolExecutor(max_workers=concurrency)

        def run_all() -> list[Outcome]:
            try:
                return list(pool.map(one, range(count)))
            finally:
                pool.shutdown(wait=False)

        return cf.ThreadPoolExecutor(max_workers=1).submit(run_all)

    def attribute(
        self, label: str, outcomes: list[Outcome], log_text: str
    ) -> dict[str, Any]:
        """`plan.attribute_wrong` of a scenario, logged in one line; every
        outcome (texts of wrong and alternate ones only) to
        OUT/outcomes_<label>.jsonl."""
        found = plan.attribute_wrong(
            outcomes, self.references, log_text, alternates=self.alternates
        )
        with open(self.args.out / f"outcomes_{label}.jsonl", "w") as out:
            for o in outcomes:
                kept = o.cls in ("wrong", "alternate")
                record = vars(o) if kept else dict(vars(o), text=None)
                out.write(json.dumps(record) + "\n")
        log(
            f"{label}: {found['wrong']} wrong by cause {found['by_cause']} "
            f"({found['alternate']} alternate); "
            f"by prompt {found['by_prompt']}; injected {found['injected_by_kind']}"
        )
        return found

    def errors(self, *names: str) -> list[str]:
        return [
            e for n in names for e in plan.unexpected_errors(self.procs[n].log_text())
        ]


def producer_kill(run: Run) -> plan.Verdict:
    args = run.args
    routers = {"recompute": "router", "fail": "router_fail"}
    consumers = {"recompute": "consumer", "fail": "consumer_fail"}
    totals = {p: dict.fromkeys(plan.CLASSES, 0) for p in routers}
    verified = {p: 0.0 for p in routers}
    fresh = {}
    marks = {p: run.procs[c].log_mark() for p, c in consumers.items()}
    outcomes: dict[str, list[Outcome]] = {p: [] for p in routers}
    kills = []
    # The kill lands after k of the 64 prefills answered (k spread over the
    # repeats), so consumers are reading from the producer when it dies: a
    # kill timed from the send landed before any prefill answered on an H200.
    for i, share in enumerate(plan.plan_offsets(args.repeats, 0.75, seed=21)):
        before = {p: run.verdict(c) for p, c in consumers.items()}
        answered = plan.gauge_total(run.procs["producer"].metrics(), ANSWERED) or 0.0
        batches = {
            p: run.fire(run.router_url(r), 32, 32, seed=100 + i)
            for p, r in routers.items()
        }
        k = max(1, round(share * 64))
        waited = run.wait_answered("producer", answered + k, timeout=30)
        run.procs["producer"].kill(signal.SIGKILL)
        kills.append({"after_prefills": k, "waited_s": waited})
        log(f"producer_kill {i}: SIGKILL after {k} prefills answered ({waited} s)")
        for p, batch in batches.items():
            outcomes[p] += batch.result()
            counts = plan.tally(outcomes[p][-32:], run.references, run.alternates)
            for k, n in counts.items():
                totals[p][k] += n
        took = run.restart("producer")
        log(f"producer_kill {i}: restarted in {took} s; {totals}")
        for p, c in consumers.items():
            verified[p] += run.verdict(c) - before[p]
    for p, r in routers.items():
        before_fresh = run.verdict(consumers[p])
        out = complete(run.router_url(r), body(run.prompts[0], args), args.timeout)
        ok = out.status == 200 and out.text in run.references[0] | run.alternates[0]
        fresh[p] = ok and run.verdict(consumers[p]) > before_fresh
    v = plan.judge_producer_kill(
        totals, verified, fresh, run.errors("consumer", "consumer_fail", "producer")
    )
    v.counts["kills"] = kills
    v.counts["attribution"] = {
        p: run.attribute(
            f"producer_kill_{p}", outcomes[p], run.procs[c].lines_since(marks[p])
        )
        for p, c in consumers.items()
    }
    return v


def client_abort(run: Run) -> plan.Verdict:
    args = run.args
    count = 32 * args.repeats
    aborts = plan.plan_aborts(count, 0.5, run.ttft_ms, args.max_tokens, seed=31)
    outcomes = run.fire(run.router_url(), count, 16, aborts, seed=32).result()
    counts = plan.tally(outcomes, run.references, run.alternates)
    counts.update({f"aborted_{p}": 0 for p in plan.PHASES})
    for o in outcomes:
        if o.aborted:
            counts[f"aborted_{o.phase}"] += 1
    gauges = {}
    if args.checksums == "on":  # the control's servers expose no gauge
        gauges = {
            "consumer": run.wait_gauge_zero("consumer", 60),
            "producer": run.wait_gauge_zero("producer", args.lease + 30),
        }
    return plan.judge_client_abort(counts, gauges, run.errors("consumer", "producer"))


def consumer_restart(run: Run) -> plan.Verdict:
    args = run.args
    v = plan.Verdict("consumer_restart")
    restarts = []
    held = 0
    for i, offset in enumerate(plan.plan_offsets(args.repeats, 0.5, seed=41)):
        # Prefills the producer answers and then holds for the consumer.
        for p in range(8):
            payload = body(run.prompts[p], args, stream=False)
            payload.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            held += (
                complete(run.procs["producer"].url, payload, args.timeout).status == 200
            )
        batch = run.fire(run.router_url(), 32, 32, seed=200 + i)
        time.sleep(offset)
        restarts.append(run.restart("consumer"))
        outcomes = batch.result()
        v.counts[f"repeat{i}"] = plan.tally(outcomes, run.references, run.alternates)
        v.checks[f"repeat {i}: no hang"] = v.counts[f"repeat{i}"]["hang"] == 0
        v.checks[f"repeat {i}: no wrong answer"] = v.counts[f"repeat{i}"]["wrong"] == 0
    before = run.verdict("consumer")
    fresh = run.fire(run.router_url(), 16, 8, seed=299).result()
    counts = plan.tally(fresh, run.references, run.alternates)
    v.counts.update(restart_s=restarts, held_prefills=held, fresh=counts)
    answered = counts["right"] + counts["alternate"]
    v.checks["new requests right or alternate"] = answered == len(fresh)
    v.checks["new requests verified"] = run.verdict("consumer") - before >= len(fresh)
    gauge = run.wait_gauge_zero("producer", args.lease + 30)
    v.counts["producer_tracked_after_lease"] = gauge
    v.checks["producer tracked requests back to 0"] = plan.gauge_back_to_zero(gauge)
    errors = run.errors("consumer", "producer")
    v.counts["checksum_error_lines"] = errors[:10]
    v.checks["no checksum error line"] = not errors
    return v


def lease_expiry(run: Run) -> plan.Verdict:
    """Prefill 32 prompts on the short-lease producer, wait past the lease,
    overwrite its small cache with fillers, then 32 pulls at once."""
    args = run.args
    producer, consumer = run.procs["producer_lease"], run.procs["consumer"]
    n = 32
    rids = [f"stale-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    picks = list(range(n))
    params: list[Any] = []
    for rid, p in zip(rids, picks):
        payload = body(run.prompts[p % len(run.prompts)], args, stream=False)
        payload.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params.append(_prefill(producer.url, payload, rid, args.timeout))
    time.sleep(args.short_lease + 2.0)
    for i, filler in enumerate(make_prompts(24, seed=4, lo=400, hi=600)):
        payload = body(filler, args, stream=False)
        payload["max_tokens"] = 1
        complete(producer.url, payload, args.timeout, request_id=f"filler-{i}")
    lines_before = consumer.log_text().count("\n")

    def pull(i: int) -> Outcome:
        p = picks[i] % len(run.prompts)
        payload = body(run.prompts[p], args, stream=False)
        if params[i]:
            payload["kv_transfer_params"] = params[i]
        return complete(
            consumer.url, payload, args.timeout, prompt=p, request_id=rids[i]
        )

    with cf.ThreadPoolExecutor(max_workers=n) as pool:
        outcomes = list(pool.map(pull, range(n)))
    new_lines = "\n".join(consumer.log_text().splitlines()[lines_before:])
    mismatched = plan.request_ids(plan.MISMATCH, new_lines)
    reported = [any(rid in m for m in mismatched) for rid in rids]
    plan.tally(outcomes, run.references, run.alternates)  # each outcome's class
    classes = [o.cls for o in outcomes]
    stale = producer.log_text().count(EXPIRED_READ)
    v = plan.judge_lease_expiry(reported, classes, stale)
    v.counts["attribution"] = run.attribute("lease_expiry", outcomes, new_lines)
    return v


def _prefill(url: str, payload: dict[str, Any], rid: str, timeout: float) -> Any:
    """The proxy's producer request; its kv_transfer_params (None on error)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(payload),
            {"Content-Type": "application/json", "X-Request-Id": rid},
        )
        response = conn.getresponse()
        reply = json.loads(response.read())
        return reply.get("kv_transfer_params") if response.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


class Sampler(threading.Thread):
    """Every few seconds: each server's RSS and GPU memory (MiB) and its
    tracked-request gauge."""

    def __init__(self, run: Run, names: list[str], every_s: float):
        super().__init__(daemon=True)
        self.run_, self.names, self.every_s = run, names, every_s
        self.halt = threading.Event()
        self.t0 = time.time()

    def gpu_by_pid(self) -> dict[int, float]:
        try:
            text = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-compute-apps=pid,used_memory",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        found = {}
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                pid, mib = line.split(",")
                found[int(pid)] = float(mib)
        return found

    def run(self) -> None:
        import psutil

        while not self.halt.wait(self.every_s):
            gpu = self.gpu_by_pid()
            for name in self.names:
                pids = self.run_.procs[name].pids()
                rss = 0.0
                for pid in pids:
                    with contextlib.suppress(psutil.Error):
                        rss += psutil.Process(pid).memory_info().rss / 2**20
                self.run_.samples.append(
                    {
                        "t": round(time.time() - self.t0, 2),
                        "server": name,
                        "rss_mib": round(rss, 1),
                        "gpu_mib": sum(gpu.get(p, 0.0) for p in pids) if gpu else None,
                        "tracked": self.run_.gauge(name),
                    }
                )


def soak(run: Run) -> plan.Verdict:
    args = run.args
    consumer = run.procs["consumer"]
    spec = run.topology.server("consumer")
    # Restart with the injector on, and with --soak-policy as the consumer's
    # kv_load_failure_policy when it differs (the "fail" control).
    if plan.soak_consumer(spec, args.soak_fault_rate, args.soak_policy, args.checksums):
        consumer.cmd = server_proc(spec, args).cmd
        run.restart("consumer", signal.SIGTERM)
    lines_before = consumer.log_text().count("\n")
    n = args.soak_requests
    aborts = plan.plan_aborts(
        n, args.soak_abort_rate, run.ttft_ms, args.max_tokens, seed=51
    )
    sampler = Sampler(run, ["producer", "consumer"], args.sample_s)
    sampler.start()
    t0 = time.time()
    outcomes: list[Outcome] = []
    # Rounds of n requests until --soak-min-s has passed too: a memory slope
    # over 1.1 minutes (20,000 requests on an H200) says little.
    while not outcomes or time.time() - t0 < args.soak_min_s:
        seed = 52 + len(outcomes) // n
        outcomes += run.fire(
            run.router_url(), n, args.soak_concurrency, aborts, seed=seed
        ).result()
    log(f"soak: {len(outcomes)} requests in {time.time() - t0:.0f} s")
    gauges = {}
    if args.checksums == "on":  # the control's servers expose no gauge
        gauges = {
            "consumer": run.wait_gauge_zero("consumer", 60),
            "producer": run.wait_gauge_zero("producer", args.lease + 30),
        }
    time.sleep(args.sample_s)
    sampler.halt.set()
    sampler.join()
    new_lines = "\n".join(consumer.log_text().splitlines()[lines_before:])
    memory = {}
    for name in ("producer", "consumer"):
        for key in ("rss_mib", "gpu_mib"):
            series = [
                (s["t"], float(s[key]))
                for s in run.samples
                if s["server"] == name and s[key] is not None
            ]
            memory[f"{name} {key}"] = plan.fit_slope(series)
    if args.checksums == "off":  # the control: vLLM alone under the same load
        counts = plan.tally(outcomes, run.references, run.alternates)
        v = plan.Verdict("soak", counts={"outcomes": counts, "checksums": "off"})
        v.checks["no hang"] = counts["hang"] == 0
        v.checks["no error"] = counts["error"] == 0
        v.counts["attribution"] = run.attribute("soak", outcomes, new_lines)
        return v
    injected, no_effect = plan.effective_injections(new_lines)
    v = plan.judge_soak(
        plan.tally(outcomes, run.references, run.alternates),
        injected,
        plan.request_ids(plan.MISMATCH, new_lines),
        gauges,
        memory,
        run.errors("consumer", "producer"),
        policy=args.soak_policy,
        answered={o.request_id for o in outcomes if o.status == 200 and not o.aborted},
    )
    v.counts["injections_without_effect"] = len(no_effect)
    v.counts["attribution"] = run.attribute("soak", outcomes, new_lines)
    return v


def _post_json(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _deltas(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def tamper(run: Run) -> plan.Verdict:
    """Per proxy mode, args.tamper_requests requests one at a time and
    args.tamper_concurrent at once on each endpoint through the proxy's
    router; then the off mode's requests again through the checksums-off
    consumer."""
    from benchmark_kv_checksum_serve import verdict_counts

    args, consumer = run.args, run.procs["consumer"]
    control = run.procs["proxy"].url + "/_tamper"
    chat_refs: list[set[str]] = [set() for _ in run.prompts]
    for i, prompt in enumerate(run.prompts):  # the consumer's local chat answers
        out = complete(consumer.url, body(prompt, args, chat=True), args.timeout)
        if out.text is not None:
            chat_refs[i].add(out.text)
    refs = {"completions": run.references, "chat": chat_refs}
    # Alternates were measured on completions only; chat answers have none.
    alts = {"completions": run.alternates, "chat": None}

    def batch(router: str, seed: int) -> dict[str, list[Outcome]]:
        url, n, m = run.router_url(router), args.tamper_requests, args.tamper_concurrent
        return {
            e: run.fire(url, n, 1, seed=seed, chat=e == "chat").result()
            + run.fire(url, m, m, seed=seed + 1, chat=e == "chat").result()
            for e in refs
        }

    phases, statuses = {}, {}
    for k, mode in enumerate(plan.TAMPER_EXPECT):
        rewritten = _post_json(control, {"mode": mode})["counts"][mode]
        page, lines = consumer.metrics(), consumer.log_text().count("\n")
        outcomes = batch("router_tamper", seed=600 + 10 * k)
        sent = sum(map(len, outcomes.values()))
        deadline = time.time() + 30  # the stat path lags the answers
        while True:
            verdicts = _deltas(verdict_counts(consumer.metrics()), verdict_counts(page))
            if sum(verdicts.values()) >= sent or time.time() > deadline:
                break
            time.sleep(0.5)
        new_lines = "\n".join(consumer.log_text().splitlines()[lines:])
        phases[mode] = plan.TamperPhase(
            {e: plan.tally(o, refs[e], alts[e]) for e, o in outcomes.items()},
            verdicts,
            _deltas(
                plan.labelled_counts(consumer.metrics(), UNVERIFIED, "reason"),
                plan.labelled_counts(page, UNVERIFIED, "reason"),
            ),
            json.loads(http_get(control) or "{}")["counts"][mode] - rewritten,
            len(plan.request_ids(plan.MISMATCH, new_lines)),
        )
        if mode == args.tamper_off_mode:
            statuses["on"] = [o.status for out in outcomes.values() for o in out]
            off = batch("router_off", seed=600 + 10 * k)
            statuses["off"] = [o.status for out in off.values() for o in out]
        log(f"tamper {mode}: {vars(phases[mode])}")
    _post_json(control, {"mode": "none"})
    return plan.judge_tamper(phases, consumer.log_text(), statuses)


SCENARIO_FUNCS = {
    "producer_kill": producer_kill,
    "client_abort": client_abort,
    "consumer_restart": consumer_restart,
    "lease_expiry": lease_expiry,
    "soak": soak,
    "tamper": tamper,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--scenarios",
        default="producer_kill,client_abort,consumer_restart,lease_expiry",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--connector",
        default="nixl-pull",
        choices=("nixl-pull", "nixl-push", "nixl-offload"),
    )
    parser.add_argument("--model", default="/tmp/kv-checksum-serve-tiny")
    parser.add_argument("--no-build", action="store_true", help="model folder exists")
    parser.add_argument("--serve-cmd", default=CLI, help="the vLLM CLI")
    parser.add_argument("--router-cmd", default=ROUTER)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-util", type=float, default=0.08)
    parser.add_argument("--lease", type=int, default=20, help="producer lease (s)")
    parser.add_argument("--short-lease", type=int, default=2, help="lease_expiry's")
    parser.add_argument("--timeout", type=float, default=150, help="client timeout (s)")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument(
        "--mixed-repeats",
        type=int,
        default=4,
        help="before any fault, send every prompt this many times through the "
        "router while local long prefills share the consumer's batch; texts "
        "other than the references become alternates (0: off)",
    )
    parser.add_argument("--soak-requests", type=int, default=20000)
    parser.add_argument(
        "--soak-min-s",
        type=float,
        default=0.0,
        help="repeat rounds of --soak-requests until this many seconds passed",
    )
    parser.add_argument("--soak-concurrency", type=int, default=64)
    parser.add_argument("--soak-abort-rate", type=float, default=0.05)
    parser.add_argument("--soak-fault-rate", type=float, default=0.01)
    parser.add_argument(
        "--soak-policy",
        choices=("recompute", "fail"),
        default="recompute",
        help="the soak consumer's kv_load_failure_policy; fail: the control "
        "with no local recompute in the consumer's batch (no answer may differ)",
    )
    parser.add_argument(
        "--checksums",
        choices=("on", "off"),
        default="on",
        help="off: every server without the package's flags and no injector "
        "(the soak's control: wrong answers vLLM gives alone under that load)",
    )
    parser.add_argument("--sample-s", type=float, default=3.0)
    parser.add_argument("--tamper-requests", type=int, default=8, help="one by one")
    parser.add_argument("--tamper-concurrent", type=int, default=8, help="at once")
    parser.add_argument(
        "--tamper-off-mode", default="garbage", help="also run behind checksums off"
    )
    parser.add_argument(
        "--port-offset",
        type=int,
        # gpu_runs.sh `group` runs several drivers on one host, ports apart.
        default=int(os.environ.get("KV_CHECKSUM_PORT_OFFSET", "0")),
        help="every port + N (default: $KV_CHECKSUM_PORT_OFFSET or 0)",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scenarios = args.scenarios.split(",")
    # Soak last: it turns the consumer's injector on.
    scenarios = sorted(scenarios, key=lambda s: s == "soak")
    if not args.no_build:
        from kv_checksum_serve_pd import build_model

        build_model(args)
    if args.checksums == "off":
        args.soak_fault_rate = 0.0
    # The mixed references need the injector off: with them the consumer
    # starts without it even for a soak-only run, and soak() restarts it with
    # the injector on (one consumer restart more).
    first_rate = 0.0 if args.mixed_repeats > 0 else args.soak_fault_rate
    topology = plan.shift_ports(
        plan.plan_topology(scenarios, args.lease, args.short_lease, first_rate),
        args.port_offset,
    )
    if args.checksums == "off":
        topology = plan.without_checksums(topology)
    run = Run(args, topology)
    summary: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "scenarios": {},
    }
    try:
        run.start_all()
        run.references_from("consumer")
        run.mixed_references("consumer")
        summary["alternates"] = {
            str(p): len(a) for p, a in enumerate(run.alternates) if a
        }
        for name in scenarios:
            t0 = time.time()
            try:
                verdict = SCENARIO_FUNCS[name](run)
                entry = {
                    "pass": verdict.passed,
                    "counts": verdict.counts,
                    "checks": verdict.checks,
                }
            except Exception as e:  # a scenario's crash is its failure, not the run's
                entry = {"pass": False, "error": repr(e)}
            entry["seconds"] = round(time.time() - t0, 1)
            summary["scenarios"][name] = entry
            verdict_word = "PASS" if entry["pass"] else "FAIL"
            log(f"{name}: {verdict_word} {json.dumps(entry, default=str)[:1500]}")
    except RuntimeError as e:
        summary["error"] = str(e)
        log(f"run failed: {e}")
    finally:
        run.stop_all()
        summary["samples"] = run.samples
        summary["pass"] = (
            bool(summary["scenarios"])
            and "error" not in summary
            and all(s["pass"] for s in summary["scenarios"].values())
        )
        (args.out / "summary.json").write_text(
            json.dumps(summary, indent=1, default=str)
        )
    log(f"PASS: {summary['pass']}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
