# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The P/D connector of `kv_checksum_pd_gpu.py` (its ``--connector`` option).

- ``nixl-pull`` (default): NixlConnector, kv_both; the consumer gets the
  producer's returned kv_transfer_params (the engines as before).
- ``nixl-push``: NixlPushConnector, kv_both; the same params exchange (the
  producer WRITEs into the consumer's blocks after its registration).
- ``nixl-offload``: MultiConnector(NixlConnector, OffloadingConnector), the
  production pair: P/D loads verified by the NIXL path with an offload tier
  beside it (issue 16, part 2).
- ``mooncake``: MooncakeConnector over Mooncake's TCP transport
  (``mooncake_protocol: "tcp"``), producer kv_producer and consumers
  kv_consumer, each engine with its own engine id and bootstrap port; the
  driver plays the router: one transfer id per request, the consumer's params
  (remote engine id, bootstrap address, transfer id) built here.

The reference engine ``ref`` (checksums off) stays on NIXL pull: it only
computes the single-engine outputs. Mooncake's engine library links
libibverbs, libmlx5, libnuma and libcurl; where the host lacks them,
`configure` links the copies the NIXL wheel bundles into a folder on
LD_LIBRARY_PATH (set before the engine processes start) and records a
preflight of ``TransferEngine()`` in the summary.
"""

import ctypes
import glob
import itertools
import os
import subprocess
import sys
import uuid
from typing import Any

CONNECTOR_ENV = "KV_CHECKSUM_PD_CONNECTOR"
# The request id the driver chooses (see `producer_params`).
REQUEST_ID = "_request_id"
REQUEST_NUMBERS = itertools.count(10**9)
CHOICES = ("nixl-pull", "nixl-push", "mooncake", "nixl-offload")
# nixl-offload: the common production pair, P/D loads through NIXL pull and a
# CPU offload tier beside it (its own loads are checked by the offload driver).
NIXL_OFFLOAD = [
    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
    },
]
BOOTSTRAP_OFFSET = 10
MOONCAKE_SYSTEM_LIBS = (
    "libibverbs.so.1",
    "libmlx5.so.1",
    "libnuma.so.1",
    "libcurl.so.4",
)
PRODUCERS = ("producer", "off_again")


def connector() -> str:
    return os.environ.get(CONNECTOR_ENV, "nixl-pull")


def producer_params() -> dict:
    """A producer request's kv_transfer_params (Mooncake: a new transfer id).

    ``REQUEST_ID`` (taken out by the engine before vLLM sees the params) is
    the request id of both the producer and the consumer request, as a proxy
    gives both one X-Request-Id: NIXL push matches a consumer's registration
    to the producer's finished blocks by that id, and the offline engines'
    own counters ("0", "1", ...) drift apart as soon as one producer serves
    two consumers. Ids are numbers because `LLM.generate` sorts its outputs
    by int(request id); they grow, so a batch keeps its order.
    """
    params: dict[str, Any] = {
        "do_remote_decode": True,
        REQUEST_ID: str(next(REQUEST_NUMBERS)),
    }
    if connector() == "mooncake":
        params["transfer_id"] = f"kvc-{uuid.uuid4().hex}"
    return params


def consumer_params(producer: str, port: int, sent: dict, returned: Any) -> dict:
    """The consumer request's kv_transfer_params after a producer request."""
    if connector() != "mooncake":
        kvp = dict(returned or {})
        kvp.pop("remote_prefill_cached_tokens", None)
        kvp[REQUEST_ID] = sent[REQUEST_ID]
        return kvp
    return {
        REQUEST_ID: sent[REQUEST_ID],
        "do_remote_prefill": True,
        "remote_engine_id": engine_id(producer),
        "remote_bootstrap_addr": f"http://127.0.0.1:{port + BOOTSTRAP_OFFSET}",
        "transfer_id": sent["transfer_id"],
    }


def engine_id(name: str) -> str:
    return f"kvc-{name}"


def configure(specs: list[tuple[str, dict, int]], name: str) -> dict[str, Any]:
    """Set every engine but ``ref`` to connector `name`; returns what the
    summary should record (Mooncake: the library preflight)."""
    os.environ[CONNECTOR_ENV] = name
    info: dict[str, Any] = {"connector": name}
    if name == "nixl-pull":
        return info
    for i, (engine, extra, port) in enumerate(specs):
        if engine == "ref":
            continue
        extra = dict(extra)
        if name == "nixl-push":
            extra["_connector"] = "NixlPushConnector"
        elif name == "nixl-offload":
            extra.update(_connector="MultiConnector", connectors=NIXL_OFFLOAD)
            # The sync check is for this package: vLLM's offload worker is not.
            extra["_env"] = {**extra.get("_env", {}), "KV_CHECKSUM_SYNC_CHECK": "0"}
        else:
            extra.update(
                _connector="MooncakeConnector",
                _role="kv_producer" if engine in PRODUCERS else "kv_consumer",
                _engine_id=engine_id(engine),
                mooncake_protocol="tcp",
            )
            extra["_env"] = {
                **extra.get("_env", {}),
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port + BOOTSTRAP_OFFSET),
                "VLLM_HOST_IP": "127.0.0.1",
                # Producer blocks of requests nobody pulls (equality phase).
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "60",
            }
        specs[i] = (engine, extra, port)
    if name == "mooncake":
        info.update(mooncake_libraries())
    return info


def mooncake_libraries() -> dict[str, Any]:
    """Link missing system libraries to NIXL's copies; preflight the engine."""
    shim = os.path.join("/tmp", "kv-checksum-mooncake-libs")
    os.makedirs(shim, exist_ok=True)
    nixl_libs = [
        d for p in sys.path for d in glob.glob(os.path.join(p or ".", "nixl_cu13.libs"))
    ]
    linked = {}
    for lib in MOONCAKE_SYSTEM_LIBS:
        try:
            ctypes.CDLL(lib)
            continue
        except OSError:
            pass
        stem = lib.split(".so")[0]
        copies = [c for d in nixl_libs for c in glob.glob(os.path.join(d, f"{stem}-*"))]
        if copies:
            target = os.path.join(shim, lib)
            if os.path.lexists(target):
                os.remove(target)
            os.symlink(copies[0], target)
            linked[lib] = copies[0]
    if linked:
        old = os.environ.get("LD_LIBRARY_PATH", "")
        os.environ["LD_LIBRARY_PATH"] = f"{shim}:{old}" if old else shim
    check = (
        "import torch; from mooncake.engine import TransferEngine; "
        "e = TransferEngine(); "
        "print('initialize', e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', ''))"
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", check],
            capture_output=True,
            text=True,
            timeout=60,
        )
        preflight = {"rc": run.returncode, "out": (run.stdout + run.stderr)[-3000:]}
    except Exception as e:  # report, never abort the driver
        preflight = {"rc": None, "out": repr(e)}
    print(f"[gpu] mooncake libraries linked {linked}; preflight {preflight}")
    return {"mooncake_linked_libs": linked, "mooncake_preflight": preflight}
