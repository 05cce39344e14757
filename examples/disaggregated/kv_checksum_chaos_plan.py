# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pure logic of `kv_checksum_chaos.py`: which servers a run needs, when
to abort or kill, and how a scenario is judged from what was collected.

No process, socket or clock here: every function takes plain inputs, so the
CPU tests (tests/v1/kv_connector/unit/test_kv_checksum_chaos_driver.py) check
it on hand-made records.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from typing import Any

SCENARIOS = (
    "producer_kill",
    "client_abort",
    "consumer_restart",
    "lease_expiry",
    "soak",
    "tamper",
)
# Where a client abort lands in a P/D request's life (R141: "whatever the point").
PHASES = ("before_load", "during_load", "before_verify", "during_decode")
# Each time-based phase as a window of the request's time to first chunk.
PHASE_WINDOWS = {
    "before_load": (0.0, 0.3),
    "during_load": (0.3, 0.7),
    "before_verify": (0.7, 1.0),
}
TRACKED_GAUGE = "vllm:kv_checksum_tracked_requests"
# Greedy up to ": ": router request ids hold colons ("___prefill_addr_h:p...").
MISMATCH = re.compile(r"KV checksum mismatch for request (\S+): ")
INJECTED = re.compile(r"KV checksum fault injection: \w+ into request (\S+) ")
INJECTED_KIND = re.compile(r"KV checksum fault injection: (\w+) into request (\S+) ")
# The injector's later line for a copy whose source held the same bytes.
NO_EFFECT = re.compile(
    r"KV checksum fault injection had no effect: \w+ into request (\S+) "
)
QUARANTINED = re.compile(r"quarantined \d+ loaded blocks of request (\S+) ")
# A consumer's engine request id: the completion id a client gets, then
# "-<prompt index>" (completions only) and vLLM's random "-<8 hex>".
ENGINE_SUFFIX = re.compile(r"-\d+-[0-9a-f]{8}$")
CHAT_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
# The consumer's warning per unverified reason (the guide's "Log lines").
NOT_VERIFIED = "KV checksums not verified: {}."
NO_CHECKSUMS = "the producer sent no checksums"
INVALID_CHECKSUMS = "the producer's checksums are invalid"
# What a consumer reports per proxy mode (kv_checksum_tamper_proxy.py): the
# verdicts it may give and the unverified reason label and text it must log.
TAMPER_EXPECT: dict[str, tuple[tuple[str, ...], str | None, str | None]] = {
    "none": (("verified",), None, None),
    "drop": (("unverified",), "no_checksums", NO_CHECKSUMS),
    "truncate": (("unverified",), "invalid_checksums", INVALID_CHECKSUMS),
    "garbage": (("unverified",), "invalid_checksums", INVALID_CHECKSUMS),
    "other": (("mismatch", "unverified"), None, None),
}
# An exception frame inside the package: an error from checksum code too.
PACKAGE_FRAME = re.compile(r'File "[^"]*kv_checksum/[^"]*"')


@dataclass
class ServerSpec:
    """One `vllm serve` instance of a run (ports, role and checksum settings)."""

    name: str
    port: int
    side_port: int
    role: str  # "producer" or "consumer"
    checksums: bool = True
    fail_closed: bool = False
    policy: str | None = None  # kv_load_failure_policy of a consumer
    faults: float = 0.0
    lease_s: int | None = None
    num_blocks: int | None = None


@dataclass(frozen=True)
class RouterSpec:
    """One vllm-router in front of a producer and a consumer."""

    name: str
    port: int
    prom_port: int
    producer: str
    consumer: str


@dataclass(frozen=True)
class ProxySpec:
    """A tamper proxy in front of a producer (kv_checksum_tamper_proxy.py)."""

    name: str
    port: int
    upstream: str


@dataclass
class Topology:
    """The servers, proxies and routers a set of scenarios needs."""

    servers: list[ServerSpec]
    routers: list[RouterSpec]
    proxies: list[ProxySpec] = field(default_factory=list)

    def server(self, name: str) -> ServerSpec:
        return next(s for s in self.servers if s.name == name)


def plan_topology(
    scenarios: list[str], lease_s: int, short_lease_s: int, soak_fault_rate: float
) -> Topology:
    """Producer + recompute consumer behind router :8000 always; a fail-policy
    consumer behind :8001 for producer_kill; a short-lease small-cache
    producer for lease_expiry; for tamper a proxy before the producer, a
    router through it to the consumer (:8002) and one to a checksums-off
    consumer (:8003). The consumer's injector is on from the start
    only when the soak is the only scenario (else the driver turns it on)."""
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}")
    soak_only = set(scenarios) == {"soak"}
    servers = [
        ServerSpec("producer", 8100, 5600, "producer", lease_s=lease_s),
        ServerSpec(
            "consumer",
            8200,
            5700,
            "consumer",
            fail_closed=True,
            policy="recompute",
            faults=soak_fault_rate if soak_only else 0.0,
        ),
    ]
    routers = [RouterSpec("router", 8000, 29000, "producer", "consumer")]
    if "producer_kill" in scenarios:
        servers.append(
            ServerSpec(
                "consumer_fail", 8300, 5800, "consumer", fail_closed=True, policy="fail"
            )
        )
        routers.append(
            RouterSpec("router_fail", 8001, 29001, "producer", "consumer_fail")
        )
    if "lease_expiry" in scenarios:
        servers.append(
            ServerSpec(
                "producer_lease",
                8400,
                5900,
                "producer",
                lease_s=short_lease_s,
                num_blocks=256,
            )
        )
    proxies = []
    if "tamper" in scenarios:
        # The router's prefill URL is the proxy; a checksums-off consumer
        # shows the HTTP results a client gets without checksums.
        proxies.append(ProxySpec("proxy", 8600, "producer"))
        servers.append(ServerSpec("consumer_off", 8500, 6000, "consumer", False))
        routers.append(RouterSpec("router_tamper", 8002, 29002, "proxy", "consumer"))
        routers.append(RouterSpec("router_off", 8003, 29003, "proxy", "consumer_off"))
    return Topology(servers, routers, proxies)


def without_checksums(topology: Topology) -> Topology:
    """The same servers with the package's flags off and no injector (the
    soak's control run); vLLM's own settings (policy, lease) unchanged."""
    servers = [
        replace(s, checksums=False, fail_closed=False, faults=0.0)
        for s in topology.servers
    ]
    return replace(topology, servers=servers)


def kv_transfer_config(spec: ServerSpec, connector: str) -> dict[str, Any]:
    """The --kv-transfer-config of a server (the launch script's, plus the
    run's lease, injector and policy; `connector` as in kv_checksum_pd_gpu)."""
    extra: dict[str, Any] = {}
    if spec.checksums:
        extra["enable_kv_checksum"] = True
    if spec.fail_closed:
        extra["kv_checksum_fail_closed"] = True
    if spec.faults:
        extra["kv_checksum_fault_injection"] = {"rate": spec.faults, "seed": 7}
    if spec.lease_s is not None:
        extra["kv_lease_duration"] = spec.lease_s
    nixl = "NixlPushConnector" if connector == "nixl-push" else "NixlConnector"
    config: dict[str, Any] = {"kv_connector": nixl, "kv_role": "kv_both"}
    if connector == "nixl-offload":
        offload = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
        }
        config["kv_connector"] = "MultiConnector"
        extra["connectors"] = [dict(config, kv_connector=nixl), offload]
    if spec.policy:
        config["kv_load_failure_policy"] = spec.policy
    config["kv_connector_extra_config"] = extra
    return config


@dataclass(frozen=True)
class AbortPlan:
    """When a client closes one request: after `after_ms` (no chunk needed)
    or after reading `after_chunks` streamed chunks."""

    phase: str
    after_ms: float | None = None
    after_chunks: int | None = None


def plan_aborts(
    count: int, rate: float, ttft_ms: float, max_tokens: int, seed: int
) -> list[AbortPlan | None]:
    """Which of `count` requests abort (round(count * rate) of them, chosen at
    random) and where; the phases take turns so each gets its share."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(count), round(count * rate)))
    plans: list[AbortPlan | None] = [None] * count
    for turn, index in enumerate(chosen):
        phase = PHASES[turn % len(PHASES)]
        if phase == "during_decode":
            plans[index] = AbortPlan(
                phase, after_chunks=rng.randint(1, max(1, max_tokens - 1))
            )
        else:
            lo, hi = PHASE_WINDOWS[phase]
            plans[index] = AbortPlan(phase, after_ms=ttft_ms * rng.uniform(lo, hi))
    return plans


def plan_offsets(repeats: int, window_s: float, seed: int) -> list[float]:
    """One kill (or restart) time per repeat, stratified over [0, window_s):
    repeat i falls in the i-th slice, so together they cover the window."""
    rng = random.Random(seed)
    width = window_s / repeats
    return [width * (i + rng.random()) for i in range(repeats)]


@dataclass
class Outcome:
    """What one client request ended as."""

    status: int  # HTTP status; 0: no response (connection refused or reset)
    text: str | None = None
    elapsed_s: float = 0.0
    aborted: bool = False  # the client closed it on purpose
    hung: bool = False  # no end before the client's timeout
    phase: str = ""
    error: str = ""
    prompt: int = 0  # index into the run's prompts
    request_id: str = ""  # the response's id (the consumer's completion id)
    sent_s: float = 0.0  # monotonic, from the driver's start
    finished_s: float = 0.0
    cls: str = ""  # `classify`'s class, set by `tally`


# `classify`'s classes; "alternate" is a prompt's second deterministic answer
# measured before any fault (`collect_alternates`), neither right nor wrong.
CLASSES = ("right", "alternate", "wrong", "error", "hang", "aborted")


def classify(
    outcome: Outcome, right: set[str], alternates: set[str] | None = None
) -> str:
    """aborted, hang, error, right, alternate (a text of `alternates`: the
    prompt's other answer when recomputes share the batch) or wrong (a 200
    whose text is neither)."""
    if outcome.aborted:
        return "aborted"
    if outcome.hung:
        return "hang"
    if outcome.status != 200 or outcome.text is None:
        return "error"
    if outcome.text in right:
        return "right"
    return "alternate" if alternates and outcome.text in alternates else "wrong"


def tally(
    outcomes: list[Outcome],
    references: list[set[str]],
    alternates: list[set[str]] | None = None,
) -> dict[str, int]:
    """Counts of `classify` over a run (every class of CLASSES present, zeros
    kept); each outcome keeps its class in `cls`."""
    counts = dict.fromkeys(CLASSES, 0)
    for outcome in outcomes:
        outcome.cls = classify(
            outcome,
            references[outcome.prompt],
            alternates[outcome.prompt] if alternates else None,
        )
        counts[outcome.cls] += 1
    return counts


def collect_alternates(
    outcomes: list[Outcome], references: list[set[str]]
) -> list[set[str]]:
    """Per prompt, the answered texts (HTTP 200, a text) that are none of its
    references: the second regime measured with no fault on (a recompute in
    the consumer's batch breaks batch invariance on near-tie prompts)."""
    found: list[set[str]] = [set() for _ in references]
    for o in outcomes:
        if (
            o.status == 200
            and o.text is not None
            and o.text not in references[o.prompt]
        ):
            found[o.prompt].add(o.text)
    return found


def completion_id(engine_id: str) -> str:
    """The completion id a client saw for a consumer log's request id."""
    chat = engine_id.startswith("chatcmpl-")
    return (CHAT_SUFFIX if chat else ENGINE_SUFFIX).sub("", engine_id)


# Why a wrong answer was wrong: its own load had a fault injected, its own
# load mismatched (no injection), another request with its prompt mismatched
# before it finished (contamination), or none of these.
CAUSES = ("injected", "mismatched", "same_prompt_mismatch", "unexplained")


@dataclass
class WrongAnswer:
    """One wrong answer and what the consumer's log says of it; `gap_s` is
    its finish minus the send of the same-prompt mismatched request (an upper
    bound of the time since that mismatch)."""

    prompt: int
    request_id: str
    sent_s: float
    finished_s: float
    cause: str
    injected_kind: str = ""
    quarantined: bool = False
    sibling: str = ""
    gap_s: float | None = None
    diverges_at: int = 0


def first_divergence(text: str, references: set[str]) -> int:
    """The word index where `text` first differs from its closest reference
    (the longest common word prefix): 0 means wrong from the first token, as
    KV that was never right gives; a late index looks like numerics drifting
    after a near-tie."""
    words = text.split()
    best = 0
    for reference in references:
        common = 0
        for a, b in zip(words, reference.split()):
            if a != b:
                break
            common += 1
        best = max(best, common)
    return best


def attribute_wrong(
    outcomes: list[Outcome],
    references: list[set[str]],
    log_text: str,
    examples: int = 50,
    texts: int = 8,
    alternates: list[set[str]] | None = None,
) -> dict[str, Any]:
    """Each wrong answer's cause (CAUSES) from the consumer's injection,
    mismatch and quarantine lines; counts by cause and by prompt, every
    injected load's class by fault kind, the first `examples` records and
    the first `texts` wrong texts beside their references (200 chars), and
    how many were wrong from their first word. An answer in its prompt's
    `alternates` is no wrong answer: counted apart (`alternate`)."""
    injected = {completion_id(r): k for k, r in INJECTED_KIND.findall(log_text)}
    mismatched = {completion_id(r) for r in MISMATCH.findall(log_text)}
    quarantined = {completion_id(r) for r in QUARANTINED.findall(log_text)}
    bad_by_prompt: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.request_id in mismatched:
            bad_by_prompt.setdefault(o.prompt, []).append(o)
    by_kind: dict[str, dict[str, int]] = {}
    wrong: list[WrongAnswer] = []
    shown: list[dict[str, Any]] = []
    alternate = 0
    for o in outcomes:
        cls = classify(
            o, references[o.prompt], alternates[o.prompt] if alternates else None
        )
        alternate += cls == "alternate"
        kind = injected.get(o.request_id, "")
        if kind:
            by_kind.setdefault(kind, {})
            by_kind[kind][cls] = by_kind[kind].get(cls, 0) + 1
        if cls != "wrong":
            continue
        w = WrongAnswer(o.prompt, o.request_id, o.sent_s, o.finished_s, "unexplained")
        w.injected_kind, w.quarantined = kind, o.request_id in quarantined
        w.diverges_at = first_divergence(o.text or "", references[o.prompt])
        if kind:
            w.cause = "injected"
        elif o.request_id in mismatched:
            w.cause = "mismatched"
        else:
            before = [
                b
                for b in bad_by_prompt.get(o.prompt, [])
                if b.request_id != o.request_id and b.sent_s <= o.finished_s
            ]
            if before:
                last = max(before, key=lambda b: b.sent_s)
                w.cause, w.sibling = "same_prompt_mismatch", last.request_id
                w.gap_s = round(o.finished_s - last.sent_s, 3)
        wrong.append(w)
        if len(shown) < texts:
            refs = sorted(r[:200] for r in references[o.prompt])
            shown.append(
                {
                    "prompt": o.prompt,
                    "request_id": o.request_id,
                    "cause": w.cause,
                    "text": (o.text or "")[:200],
                    "references": refs,
                }
            )
    by_prompt: dict[str, int] = {}
    for w in wrong:
        by_prompt[str(w.prompt)] = by_prompt.get(str(w.prompt), 0) + 1
    seen = {o.request_id for o in outcomes}
    return {
        "wrong": len(wrong),
        "alternate": alternate,
        "by_cause": {c: sum(w.cause == c for w in wrong) for c in CAUSES},
        "by_prompt": dict(sorted(by_prompt.items(), key=lambda kv: int(kv[0]))),
        # Wrong from the first word (bad KV) or later (numerics after a tie).
        "from_first_word": sum(w.diverges_at == 0 for w in wrong),
        "later": sum(w.diverges_at > 0 for w in wrong),
        "injected_by_kind": by_kind,
        # Injected/mismatched loads whose id no outcome has (0 unless the
        # id mapping broke, or the load was not the driver's).
        "unmatched_injected": len(set(injected) - seen),
        "unmatched_mismatches": len(mismatched - seen),
        "examples": [asdict(w) for w in wrong[:examples]],
        "texts": shown,
    }


def gauge_total(metrics_text: str | None, name: str = TRACKED_GAUGE) -> float | None:
    """Sum of a gauge over its label sets in a /metrics page; None when the
    page lacks it (the server predates it: reported as n/a)."""
    found, value = False, 0.0
    for line in (metrics_text or "").splitlines():
        if line.startswith("#"):
            continue
        key, _, sample = line.rpartition(" ")
        if key.split("{")[0] == name:
            found = True
            value += float(sample)
    return value if found else None


def unexpected_errors(log_text: str) -> list[str]:
    """Error lines from checksum code other than mismatch reports: ERROR-level
    lines naming KV checksum, and exception frames inside the package."""
    lines = []
    for line in log_text.splitlines():
        if PACKAGE_FRAME.search(line) or (
            "ERROR" in line
            and ("KV checksum" in line or "kv_checksum" in line)
            and not MISMATCH.search(line)
        ):
            lines.append(line)
    return lines


def request_ids(pattern: re.Pattern[str], log_text: str) -> set[str]:
    return {m for line in log_text.splitlines() for m in pattern.findall(line)}


def split_no_effect(
    injected: set[str], no_effect: set[str], mismatched: set[str]
) -> tuple[set[str], set[str]]:
    """Injected requests whose fault changed KV, and those whose injection the
    injector logged as without effect (its copy source held the same bytes on
    the first worker). A no-effect request that was reported all the same
    stays a fault (another worker's shard may have changed)."""
    dropped = (no_effect - mismatched) & injected
    return injected - dropped, dropped


def effective_injections(log_text: str) -> tuple[set[str], set[str]]:
    """`split_no_effect` of a consumer log's injection, "no effect" and
    mismatch lines."""
    return split_no_effect(
        request_ids(INJECTED, log_text),
        request_ids(NO_EFFECT, log_text),
        request_ids(MISMATCH, log_text),
    )


@dataclass
class SlopeFit:
    """A least-squares line through the samples after warm-up."""

    slope_per_min: float | None
    mean: float | None
    window_min: float
    samples: int
    flat: bool | None


def fit_slope(
    samples: list[tuple[float, float]],
    warmup_fraction: float = 0.25,
    abs_tolerance: float = 64.0,
    rel_tolerance: float = 0.02,
) -> SlopeFit:
    """Slope (units per minute) of (seconds, value) samples after the first
    `warmup_fraction` of the time; flat when slope x window stays within
    max(abs_tolerance, rel_tolerance x mean). Fewer than 3 samples: no verdict."""
    if not samples:
        return SlopeFit(None, None, 0.0, 0, None)
    start = min(t for t, _ in samples)
    end = max(t for t, _ in samples)
    cut = start + warmup_fraction * (end - start)
    kept = [(t, v) for t, v in samples if t >= cut]
    if len(kept) < 3:
        return SlopeFit(None, None, 0.0, len(kept), None)
    n = len(kept)
    mean_t = sum(t for t, _ in kept) / n
    mean_v = sum(v for _, v in kept) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in kept)
    if var_t == 0:
        return SlopeFit(None, mean_v, 0.0, n, None)
    slope_s = sum((t - mean_t) * (v - mean_v) for t, v in kept) / var_t
    window_min = (kept[-1][0] - kept[0][0]) / 60.0
    slope_min = slope_s * 60.0
    growth = abs(slope_min) * window_min
    flat = growth <= max(abs_tolerance, rel_tolerance * abs(mean_v))
    return SlopeFit(
        round(slope_min, 4), round(mean_v, 2), round(window_min, 3), n, flat
    )


def gauge_back_to_zero(value: float | None) -> bool | None:
    """True at 0, False above, None (n/a) when the server lacks the gauge."""
    return None if value is None else value == 0


@dataclass
class Verdict:
    """A scenario's pass/fail with the counts and checks behind it."""

    name: str
    counts: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every check True; a None (n/a: gauge absent) does not fail."""
        return bool(self.checks) and all(v is not False for v in self.checks.values())


def judge_producer_kill(
    by_policy: dict[str, dict[str, int]],
    verified_delta: dict[str, float],
    fresh_ok: dict[str, bool],
    consumer_errors: list[str],
) -> Verdict:
    """recompute: no wrong answer; fail: no wrong answer either (a broken
    load must end as an HTTP error); nothing hangs; no consumer counts more
    verified loads than it gave right or alternate answers (a verified load
    beside recomputes may give its prompt's alternate); a fresh request after
    the restart verifies through every router."""
    v = Verdict(
        "producer_kill", counts={"outcomes": by_policy, "verified": verified_delta}
    )
    for policy, counts in by_policy.items():
        v.checks[f"{policy}: no wrong answer"] = counts["wrong"] == 0
        v.checks[f"{policy}: no hang"] = counts["hang"] == 0
        v.checks[f"{policy}: verified loads <= right or alternate answers"] = (
            verified_delta.get(policy, 0.0)
            <= counts["right"] + counts.get("alternate", 0)
        )
    for policy, ok in fresh_ok.items():
        v.checks[f"{policy}: fresh request after restart verified"] = ok
    v.checks["no checksum error line"] = not consumer_errors
    v.counts["checksum_error_lines"] = consumer_errors[:10]
    return v


def judge_client_abort(
    counts: dict[str, int],
    gauges: dict[str, float | None],
    errors: list[str],
) -> Verdict:
    """Every finished request right, none hangs, each server's tracked gauge
    back to 0 once idle, no checksum error line."""
    v = Verdict("client_abort", counts={"outcomes": counts, "tracked_after": gauges})
    v.checks["no wrong answer"] = counts["wrong"] == 0
    v.checks["no hang"] = counts["hang"] == 0
    v.checks["some requests aborted"] = counts["aborted"] > 0
    for name, value in gauges.items():
        v.checks[f"{name}: tracked requests back to 0"] = gauge_back_to_zero(value)
    v.checks["no checksum error line"] = not errors
    v.counts["checksum_error_lines"] = errors[:10]
    return v


def judge_lease_expiry(
    reported: list[bool], classes: list[str], stale_reads: int
) -> Verdict:
    """Per load (`classify` class): a reported one must still be answered right
    or alternate (recompute; 32 recomputes at once is the second regime), an
    unreported one must not be wrong (else a stale load went unreported); the
    incident must show (>= 1 reported). Alternates are counted, not hidden."""
    pairs = list(zip(reported, classes))
    unreported_wrong = sum(1 for r, c in pairs if not r and c == "wrong")
    reported_wrong = sum(1 for r, c in pairs if r and c not in ("right", "alternate"))
    errors = sum(1 for _, c in pairs if c in ("error", "hang"))
    v = Verdict(
        "lease_expiry",
        counts={
            "loads": len(pairs),
            "mismatches": sum(reported),
            "unreported_wrong": unreported_wrong,
            "reported_not_right": reported_wrong,
            "alternate": classes.count("alternate"),
            "errors_or_hangs": errors,
            "producer_expired_reads": stale_reads,
        },
    )
    v.checks["stale loads happened (>= 1 mismatch)"] = sum(reported) > 0
    v.checks["every stale load reported"] = unreported_wrong == 0
    v.checks["reported loads recomputed right"] = reported_wrong == 0
    v.checks["no HTTP error or hang"] = errors == 0
    return v


def soak_consumer(
    spec: ServerSpec, fault_rate: float, policy: str, checksums: str
) -> bool:
    """Set the soak's consumer up (in place): the injector at `fault_rate` if
    it has none yet, and `policy` as its kv_load_failure_policy (checksums on
    only: the off control has no policy of ours). True if it must restart."""
    restart = False
    if not spec.faults and fault_rate:
        spec.faults, restart = fault_rate, True
    if checksums == "on" and spec.policy != policy:
        spec.policy, restart = policy, True
    return restart


def judge_soak(
    counts: dict[str, int],
    injected: set[str],
    mismatched: set[str],
    gauges: dict[str, float | None],
    memory: dict[str, SlopeFit],
    errors: list[str],
    policy: str = "recompute",
    answered: Collection[str] = (),
) -> Verdict:
    """0 false mismatches (every mismatch an injected fault); every injected
    fault reported except at most one per aborted request (an abort before
    verification ends the request unverified), and none of a request the
    client got an answer for (`answered`: completion ids of answered
    requests); no wrong answer, no hang; gauges 0 at the end; memory flat
    after warm-up; no checksum error line.

    `policy` "fail" (the consumer's kv_load_failure_policy; the control of the
    recompute soak's second-regime answers): a failed load ends its request
    with an error instead of a local recompute, so no prefill ever shares the
    consumer's batch. Then no answer may differ from the references at all (no
    alternate either) and there are no more errors than reported mismatches."""
    false = mismatched - injected
    unreported = injected - mismatched
    v = Verdict(
        "soak",
        counts={
            "outcomes": counts,
            "injected": len(injected),
            "mismatches": len(mismatched),
            "false_mismatches": len(false),
            "unreported_injected": len(unreported),
            "tracked_after": gauges,
            "memory": {k: vars(fit) for k, fit in memory.items()},
            "checksum_error_lines": errors[:10],
        },
    )
    v.checks["0 false mismatches"] = not false
    unreported_answered = {completion_id(r) for r in unreported} & set(answered)
    v.counts["unreported_answered"] = sorted(unreported_answered)
    v.checks["every injected fault reported (aborted ones aside)"] = (
        len(unreported) <= counts["aborted"] and not unreported_answered
    )
    v.checks["faults were injected"] = bool(injected)
    v.checks["no wrong answer"] = counts["wrong"] == 0
    v.checks["no hang"] = counts["hang"] == 0
    v.counts["policy"] = policy
    if policy == "fail":
        v.checks["fail: no alternate answer"] = counts.get("alternate", 0) == 0
        v.checks["fail: errors <= reported mismatches"] = counts["error"] <= len(
            mismatched
        )
    for name, value in gauges.items():
        v.checks[f"{name}: tracked requests back to 0"] = gauge_back_to_zero(value)
    for name, fit in memory.items():
        v.checks[f"{name}: flat after warm-up"] = fit.flat
    v.checks["no checksum error line"] = not errors
    return v


def shift_ports(topology: Topology, offset: int) -> Topology:
    """Every port of `topology` moved by `offset` (a dry run's free range)."""
    return Topology(
        [
            replace(s, port=s.port + offset, side_port=s.side_port + offset)
            for s in topology.servers
        ],
        [
            replace(r, port=r.port + offset, prom_port=r.prom_port + offset)
            for r in topology.routers
        ],
        [replace(p, port=p.port + offset) for p in topology.proxies],
    )


def labelled_counts(
    metrics_text: str | None, name: str, label: str
) -> dict[str, float]:
    """A counter's samples in a /metrics page summed by one label's value."""
    pattern = re.compile(rf'{label}="([^"]*)"')
    counts: dict[str, float] = {}
    for line in (metrics_text or "").splitlines():
        key, _, sample = line.rpartition(" ")
        found = pattern.search(key)
        if key.split("{")[0] == name and found:
            counts[found[1]] = counts.get(found[1], 0.0) + float(sample)
    return counts


@dataclass
class TamperPhase:
    """What one proxy mode produced: client outcomes per endpoint (`tally`),
    the consumer's verdict and unverified-reason deltas, the proxy's rewrites."""

    outcomes: dict[str, dict[str, int]]
    verdicts: dict[str, float]
    reasons: dict[str, float]
    rewritten: int
    mismatch_lines: int = 0  # MISMATCH lines the consumer logged meanwhile


def judge_tamper(
    phases: dict[str, TamperPhase],
    consumer_log: str,
    statuses: dict[str, list[int]],
) -> Verdict:
    """Every answer right (HTTP 200, a reference text) or a measured alternate
    (a swapped mode's recomputes share the batch) in every mode; per mode
    the verdicts and reason of TAMPER_EXPECT for every request and 0 verified
    under a tampered mode; each reason's warning in the consumer log (logged
    once per reason, so the whole log); `statuses` ("on"/"off": the HTTP
    statuses of one mode through checksums-on and -off consumers) equal."""
    v = Verdict("tamper", counts={m: vars(p) for m, p in phases.items()})
    for mode, phase in phases.items():
        allowed, label, text = TAMPER_EXPECT[mode]
        sent = sum(sum(c.values()) for c in phase.outcomes.values())
        right = sum(c["right"] + c.get("alternate", 0) for c in phase.outcomes.values())
        v.checks[f"{mode}: every answer HTTP 200 and right or alternate"] = (
            sent > 0 and right == sent
        )
        v.checks[f"{mode}: every prefill seen by the proxy"] = phase.rewritten >= sent
        expected = sum(phase.verdicts.get(k, 0.0) for k in allowed)
        v.checks[f"{mode}: {'/'.join(allowed)} for every request"] = expected >= sent
        if mode != "none":
            v.checks[f"{mode}: 0 verified"] = phase.verdicts.get("verified", 0.0) == 0
        if label is not None:
            v.checks[f"{mode}: reason {label} counted"] = (
                phase.reasons.get(label, 0.0) >= sent
            )
        if phase.verdicts.get("mismatch", 0.0):
            v.checks[f"{mode}: every mismatch logged"] = (
                phase.mismatch_lines >= phase.verdicts["mismatch"]
            )
        if text is not None:
            v.checks[f"{mode}: '{text}' logged"] = (
                NOT_VERIFIED.format(text) in consumer_log
            )
    on, off = statuses.get("on", []), statuses.get("off", [])
    v.counts["statuses"] = statuses
    v.checks["same HTTP statuses with checksums off"] = bool(on) and sorted(
        on
    ) == sorted(off)
    return v
