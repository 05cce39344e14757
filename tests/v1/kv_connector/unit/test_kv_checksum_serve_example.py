# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The `vllm serve` P/D example plays the proxy protocol as vLLM's toy proxy does.

The example itself runs on a GPU host; these tests check, with a recording fake
in place of HTTP, the two requests it sends per user request (R99: the
producer's ``kv_transfer_params`` reach the consumer unchanged, ``kv_checksums``
included) and that its verdict checks can fail.
"""

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = (
    Path(__file__).parents[4] / "examples" / "disaggregated" / "kv_checksum_serve_pd.py"
)


@pytest.fixture
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_checksum_serve_pd", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _args() -> argparse.Namespace:
    return argparse.Namespace(max_tokens=4, timeout=1.0)


def test_proxy_protocol_forwards_params_unchanged_r99(example: ModuleType) -> None:
    """Producer: max_tokens 1 and do_remote_decode; consumer: the reply's params.

    Bugs this fails: rebuilding the consumer's params from known keys (drops
    kv_checksums); adding ``min_tokens: null`` as the toy proxy does, which
    vLLM 0.33.0's CompletionRequest refuses.
    """
    sent: list[tuple[str, dict[str, Any]]] = []
    params = {"remote_block_ids": [3, 4], "kv_checksums": "AAEC", "x-unknown": 1}

    def post(server: Any, body: dict, rid: str, timeout: float) -> tuple[int, Any]:
        sent.append((server.name, body))
        if server.name == "producer":
            return 200, {"kv_transfer_params": dict(params)}
        return 200, {"choices": [{"token_ids": [7, 8]}]}

    example.post = post
    servers = example.make_servers({"serve"})
    flow = example.pd(servers["producer"], servers["consumer"], "t5 t6", "t", _args())
    (p_name, p_body), (c_name, c_body) = sent
    assert (p_name, c_name) == ("producer", "consumer")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert c_body["kv_transfer_params"] == params
    assert c_body["max_tokens"] == 4
    assert "min_tokens" not in p_body and "min_tokens" not in c_body
    assert p_body["cache_salt"] == c_body["cache_salt"] == flow.request_id
    assert flow.has_checksums and flow.tokens == [7, 8]


def test_server_configs_are_the_quick_start_r1(example: ModuleType) -> None:
    """Only the two documented keys turn checksums on; the reference is off.

    Bug this fails: a reference consumer that still checks (then "equal to a
    checksums-off consumer" compares checksums with checksums).
    """
    servers = example.make_servers({"serve", "stale"})
    consumer = servers["consumer"].kv_transfer_config()
    assert consumer["kv_load_failure_policy"] == "recompute"
    assert consumer["kv_connector_extra_config"] == {
        "enable_kv_checksum": True,
        "kv_checksum_fail_closed": True,
    }
    assert servers["producer"].kv_transfer_config()["kv_connector_extra_config"] == {
        "enable_kv_checksum": True
    }
    assert (
        servers["consumer_off"].kv_transfer_config()["kv_connector_extra_config"] == {}
    )
    stock = servers["producer_lease_off"].kv_transfer_config()
    assert stock["kv_connector_extra_config"] == {"kv_lease_duration": 2}


def test_metric_totals_filter_by_label(example: ModuleType) -> None:
    """R130: the verdict checks read the right samples of /metrics.

    Bug this fails: summing every verdict as "verified" (a run with mismatches
    would then pass "verified == requests").
    """
    samples = {
        'vllm:kv_checksum_loads_total{verdict="verified"}': 5.0,
        'vllm:kv_checksum_loads_total{verdict="mismatch"}': 2.0,
        'vllm:kv_checksum_unverified_loads_total{reason="no_checksums"}': 1.0,
    }
    name = "vllm:kv_checksum_loads_total"
    assert example.total(samples, name, verdict="verified") == 5.0
    assert example.total(samples, name, verdict="mismatch") == 2.0
    assert example.total(samples, name) == 7.0
