# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The only hooks installed on a vLLM this package does not support (R144);
the decision is in version.py.

vLLM loads the plugin before any configuration exists, so the guard sits
where configurations become engines. Only long-standing public names are
touched, each guarded on its own: either suffices, neither raises into vLLM
except to refuse a fail-closed configuration.

Hooks (target; why; how; the upstream change that lets it go):

VllmConfig.__init__
    Why: the first point where an engine's whole configuration exists, in
    the process that starts it (`vllm serve`, `LLM`), before anything runs
    How: after the original, check its kv_transfer_config: refuse
    (fail-closed) or log the one error (fail-open)
    Upstream: none; the package supports that vLLM, or is native (R146)
KVConnectorFactory.create_connector
    Why: every KV transfer starts with a connector built here, also from a
    configuration made before the plugin was loaded
    How: before the original, the same check (its error logged in the
    scheduler's process only)
    Upstream: as above

If neither name can be wrapped, `install_version_guard` returns False and
the plugin falls back to the command line (version.py).
"""

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.version import (
    UnsupportedVersionGuard,
    UnsupportedVLLMError,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_guard: UnsupportedVersionGuard | None = None


def _check(guard: UnsupportedVersionGuard, kv_transfer_config: Any, log: bool) -> None:
    """The guard's check; only its refusal and invalid flags (R8) reach vLLM."""
    try:
        guard.check(kv_transfer_config, log)
    except (UnsupportedVLLMError, ValueError):
        raise
    except Exception:
        logger.exception("vllm-kv-checksum could not read a KV transfer config.")


def _kv_transfer_config_in(values: Iterable[Any]) -> Any:
    """The KV transfer config among a call's arguments (a VllmConfig's, or
    one given itself), else None."""
    for value in values:
        if hasattr(value, "kv_transfer_config"):
            return value.kv_transfer_config
        if hasattr(value, "kv_connector_extra_config"):
            return value
    return None


def _is_worker_role(values: Iterable[Any]) -> bool:
    """Whether a connector is built for a worker (KVConnectorRole.WORKER)."""
    return any(getattr(value, "name", None) == "WORKER" for value in values)


def _wrap_config(guard: UnsupportedVersionGuard) -> bool:
    """Target: VllmConfig.__init__ (any class layout: plain or pydantic)."""
    from vllm.config import VllmConfig

    original = VllmConfig.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _check(guard, getattr(self, "kv_transfer_config", None), log=True)

    VllmConfig.__init__ = init  # type: ignore[method-assign]
    return True


def _wrap_factory(guard: UnsupportedVersionGuard) -> bool:
    """Target: KVConnectorFactory.create_connector (a class, static or plain
    method)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    raw = inspect.getattr_static(KVConnectorFactory, "create_connector")
    descriptor = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    func: Callable = raw.__func__ if descriptor is not None else raw

    @functools.wraps(func)
    def create_connector(*args: Any, **kwargs: Any) -> Any:
        values = [*args, *kwargs.values()]
        config = _kv_transfer_config_in(values)
        _check(guard, config, log=not _is_worker_role(values))
        return func(*args, **kwargs)

    wrapped = descriptor(create_connector) if descriptor else create_connector
    setattr(KVConnectorFactory, "create_connector", wrapped)  # noqa: B010
    return True


def install_version_guard(found: str) -> bool:
    """Install the guard for vLLM `found`, once per process; returns whether
    at least one hook is in place."""
    global _guard
    if _guard is not None:
        return True
    guard = UnsupportedVersionGuard(found)
    installed = []
    for wrap in (_wrap_config, _wrap_factory):
        try:
            installed.append(wrap(guard))
        except Exception:
            logger.warning(
                "vllm-kv-checksum: the version guard's %s hook is not available "
                "on vLLM %s.",
                wrap.__name__.removeprefix("_wrap_"),
                found,
                exc_info=True,
            )
    if any(installed):
        _guard = guard
    return any(installed)
