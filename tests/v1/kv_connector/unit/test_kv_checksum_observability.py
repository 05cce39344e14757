# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shipped Grafana dashboard and Prometheus alert rules name real metrics (R130).

`examples/observability/kv_checksum/grafana.json` and `alerts.yaml` are read as
Grafana and Prometheus read them (JSON, YAML). The metric names the package
exports are not listed here: they are the sample names that vLLM 0.33.0's real
`PrometheusStatLogger`, built for a checksums-on NixlConnector config, puts on the real
prometheus_client registry (the counters' `_total` included), with the label
values the counters are created with; vLLM's own metrics (which two alert rules
read) come from the same registry. The bug caught: a metric renamed in the
package (or a name written without `_total`, or a label value misspelt) leaves
a dashboard panel empty and an alert that can never fire, with no error
anywhere. How the rules behave on series is tested by promtool
(`alerts_test.yaml`, scripts/check_alerts.sh).
"""

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    make_vllm_config,
    write_model_dir,
)
from vllm.plugins import load_general_plugins
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

pytestmark = [pytest.mark.cpu, pytest.mark.kv_checksum_capability("metrics")]

REPO = Path(__file__).resolve().parents[4]
FOLDER = REPO / "examples" / "observability" / "kv_checksum"
PREFIX = "vllm:kv_checksum"
# vLLM's own per-engine labels: their values depend on the deployment.
DEPLOYMENT_LABELS = {"model_name", "engine"}
# Labels Prometheus adds to every series of a scrape target (`instance`, `job`)
# or that Kubernetes scrape configs commonly add (`namespace`, `pod`).
TARGET_LABELS = {"instance", "job", "namespace", "pod"}
# What names the engine an alert is about: every alert rule keeps these.
IDENTITY = ["namespace", "pod", "instance", "model_name", "engine"]
SEVERITIES = {"critical", "warning", "info"}

NAME = re.compile(r"vllm:[A-Za-z0-9_:]+")
CHECKSUM_NAME = re.compile(r"vllm:kv_checksum[A-Za-z0-9_:]*")
SELECTOR = re.compile(r"(vllm:[A-Za-z0-9_:]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
AGGREGATION = re.compile(
    r"\b(sum|min|max|avg|group|count|stddev|stdvar|topk|bottomk|quantile)\s*"
    r"(by|without)?\s*(\([^)]*\))?\s*\("
)


class Exported:
    """Sample names and label values on the registry, as /metrics shows them."""

    def __init__(self, samples: list[Any]) -> None:
        self.names: set[str] = set()
        self.labels: dict[str, set[str]] = defaultdict(set)
        self.values: dict[tuple[str, str], set[str]] = defaultdict(set)
        for sample in samples:
            self.names.add(sample.name)
            for label, value in sample.labels.items():
                self.labels[sample.name].add(label)
                self.values[(sample.name, label)].add(value)

    def problems(self, expr: str) -> list[str]:
        """Every metric, label or label value in `expr` that is not exported."""
        found = []
        names = set(NAME.findall(expr))
        for name in sorted(names - self.names):
            found.append(f"metric {name} is not exported")
        for name, body in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(body):
                if name not in self.names:
                    continue
                if label not in self.labels[name]:
                    found.append(f"{name} has no label {label}")
                elif (
                    op == "="
                    and label not in DEPLOYMENT_LABELS
                    and not value.startswith("$")
                    and value not in self.values[(name, label)]
                ):
                    found.append(f"{name}{{{label}}} never has the value {value!r}")
        known = set().union(
            TARGET_LABELS, *(self.labels[n] for n in names & self.names)
        )
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in known:
                    found.append(f"no metric of the expression has label {label}")
        return found


def exported_at_start(model_dir: str, checksums: bool) -> Exported:
    """What a NixlConnector API server (kv_both) exports at start-up, before
    any step, read off the real registry (the package loaded through its entry
    point, as vLLM loads it): vLLM's metrics and, with `checksums`, ours."""
    load_general_plugins()
    config = make_vllm_config(
        model_dir,
        kv_connector="NixlConnector",
        extra_config={"enable_kv_checksum": True} if checksums else {},
    )
    unregister_vllm_metrics()
    try:
        logger = PrometheusStatLogger(config)
        metrics = getattr(logger.kv_connector_prom, "kv_checksum_metrics", None)
        assert (metrics is not None) == checksums
        samples = [
            sample
            for metric in REGISTRY.collect()
            for sample in metric.samples
            if sample.name.startswith("vllm:")
        ]
    finally:
        unregister_vllm_metrics()
    return Exported(samples)


@pytest.fixture(scope="module")
def model_dir_obs(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(tmp_path_factory.mktemp("tiny-qwen3-obs"))


@pytest.fixture(scope="module")
def exported(model_dir_obs: str) -> Iterator[Exported]:
    """What a checksums-on API server exports (`exported_at_start`)."""
    yield exported_at_start(model_dir_obs, checksums=True)


def dashboard() -> dict[str, Any]:
    return json.loads((FOLDER / "grafana.json").read_text())


def dashboard_exprs() -> list[str]:
    board = dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((FOLDER / "alerts.yaml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_exported_set_is_the_packages_counters(exported: Exported):
    """R130: the exported set read off the registry holds every checksum
    counter as /metrics shows it (`_total`), with the verdict values. Catches
    a fixture that reads nothing, which would let every name through."""
    totals = {
        n for n in exported.names if n.endswith("_total") and n.startswith(PREFIX)
    }
    assert len(totals) >= 7
    assert "vllm:kv_checksum_loads_total" in totals
    assert "vllm:kv_checksum_loads" not in exported.names
    verdicts = exported.values[("vllm:kv_checksum_loads_total", "verdict")]
    assert verdicts == {"verified", "mismatch", "unverified"}


@pytest.mark.parametrize(
    "expr",
    [
        'rate(vllm:kv_checksum_loads{verdict="mismatch"}[5m]) > 0',
        "increase(vllm:kv_checksum_blocks_quarantined_total[5m]) > 0",
        'rate(vllm:kv_checksum_loads_total{verdict="mismatched"}[5m])',
        'rate(vllm:kv_checksum_loads_total{reason="no_checksums"}[5m])',
        "sum by (status) (rate(vllm:kv_checksum_loads_total[5m]))",
    ],
)
def test_checker_rejects_broken_expressions(exported: Exported, expr: str):
    """The check itself: a name without `_total`, a renamed metric, a misspelt
    label value, a label the metric lacks and a grouping by a missing label are
    each reported. Catches a checker too lenient to ever fail."""
    assert exported.problems(expr)


def test_dashboard_expressions_name_exported_metrics(exported: Exported):
    """R130: every PromQL expression of the Grafana dashboard (panel targets
    and the model_name variable query) names exported metrics, labels and
    label values only. Catches a renamed metric leaving a panel empty."""
    exprs = dashboard_exprs()
    assert exprs
    problems = {expr: exported.problems(expr) for expr in exprs}
    assert {e: p for e, p in problems.items() if p} == {}
    for expr in exprs:
        assert PREFIX in expr


def test_dashboard_shows_every_checksum_counter(exported: Exported):
    """R130, R141: every exported checksum counter, and the tracked-requests
    gauge, appears in at least one panel. Catches a metric added to the
    package that operators cannot see."""
    used = set(NAME.findall("\n".join(dashboard_exprs())))
    shown = {
        n for n in exported.names if n.startswith(PREFIX) and not n.endswith("_created")
    }
    assert "vllm:kv_checksum_tracked_requests" in shown
    assert shown - used == set()


def test_guide_lists_the_tracked_requests_gauge():
    """R141: the guide's metrics table has a row for the tracked-requests
    gauge. Catches the gauge shipped without its documentation."""
    guide = (REPO / "docs/features/kv_checksum.md").read_text()
    assert "| `vllm:kv_checksum_tracked_requests` (gauge) |" in guide


def test_dashboard_form():
    """The dashboard imports as vLLM's example does: Prometheus targets through
    the DS_PROMETHEUS data source variable, a model_name variable, unique panel
    ids. Catches panels bound to one Grafana instance's data source uid."""
    board = dashboard()
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["DS_PROMETHEUS", "model_name"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert '$model_name"' in target["expr"]


def test_alert_expressions_name_exported_metrics(exported: Exported):
    """R130: every alert rule's expression names exported metrics, labels and
    label values only. Catches an alert that can never fire because the metric
    it watches was renamed."""
    rules = alert_rules()
    assert rules
    problems = {r["alert"]: exported.problems(r["expr"]) for r in rules}
    assert {a: p for a, p in problems.items() if p} == {}


def test_alert_rules_form():
    """Each rule has what Prometheus and a pager need: a unique name, an
    expression on a checksum metric, `for`, a known severity, a summary and a
    description. Catches a rule Prometheus loads but nobody can route."""
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert PREFIX in rule["expr"]
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in SEVERITIES
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
    severities = {r["alert"]: r["labels"]["severity"] for r in rules}
    assert severities["KVChecksumMismatch"] == "critical"
    assert severities["KVChecksumWorkerDisabled"] == "critical"


def test_alert_rules_keep_the_instance():
    """Every aggregation of every alert rule groups by the labels that name the
    engine (`IDENTITY`: the scrape target's instance, Kubernetes namespace and
    pod where set, vLLM's model_name and engine), every match of two sides
    matches on them, and each rule's summary and description name
    `$labels.instance`. Bug caught (issue 75): rules aggregating
    `by (model_name, engine)`, which drops `instance` and `pod`, so in a fleet
    the alert could not say which consumer is bad."""
    for rule in alert_rules():
        name, expr = rule["alert"], rule["expr"]
        aggregations = AGGREGATION.findall(expr)
        assert aggregations, name
        for op, mode, group in aggregations:
            labels = {label.strip() for label in group.strip("()").split(",")}
            assert mode == "by" and set(IDENTITY) <= labels, (name, op, group)
        for group in re.findall(r"\b(on|ignoring)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in group[1].split(",")}
            assert group[0] == "on" and set(IDENTITY) <= labels, (name, group)
        for annotation in ("summary", "description"):
            assert "$labels.instance" in rule["annotations"][annotation], name


def test_absence_rule_reads_series_registered_at_start_up(
    exported: Exported, model_dir_obs: str
):
    """R130, R144: KVChecksumMetricsAbsent compares a vLLM series that every
    KV consumer registers at start-up with a checksum series. With checksums
    on both exist before the first step, with the labels the rule matches on,
    so the rule stays quiet on a healthy consumer that has seen no traffic;
    with checksums off (as when the plugin did not install) vLLM's exists and
    no checksum series does, so it fires. Bugs caught: a checksum series
    created at its first event only (every idle healthy consumer would alert)
    and a vLLM series a consumer does not register at start (the rule could
    never fire)."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "KVChecksumMetricsAbsent"]
    names = NAME.findall(rule["expr"])
    vllm_series, checksum_series = names[0], names[-1]
    assert checksum_series.startswith(PREFIX)
    assert not vllm_series.startswith(PREFIX)
    assert {vllm_series, checksum_series} <= exported.names
    matched = set(IDENTITY) - TARGET_LABELS
    assert matched <= exported.labels[vllm_series]
    assert matched <= exported.labels[checksum_series]
    off = exported_at_start(model_dir_obs, checksums=False)
    assert vllm_series in off.names
    assert not {n for n in off.names if n.startswith(PREFIX)}


DOCS = [
    "README.md",
    "docs/features/kv_checksum.md",
    "docs/design/kv_checksum.md",
    "benchmarks/results/README.md",
]


def test_docs_name_exported_metrics(exported: Exported):
    """R130: every `vllm:kv_checksum...` name in the guide, the design, the
    results and the README is one /metrics shows. Catches a doc telling
    operators to query a name without `_total` (an empty result)."""
    wrong = {
        doc: sorted(
            set(CHECKSUM_NAME.findall((REPO / doc).read_text())) - exported.names
        )
        for doc in DOCS
    }
    assert {doc: names for doc, names in wrong.items() if names} == {}


def test_guide_lists_the_shipped_alerts():
    """The user guide's alert table and alerts.yaml name the same alerts.
    Catches a rule added, renamed or dropped on one side only."""
    guide = (REPO / "docs/features/kv_checksum.md").read_text()
    in_guide = set(re.findall(r"`(KVChecksum[A-Za-z]+)`", guide))
    assert in_guide == {rule["alert"] for rule in alert_rules()}
