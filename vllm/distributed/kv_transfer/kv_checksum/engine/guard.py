# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The last-resort guard around checksum code in vLLM's step (R134): an error
is logged once and turns checksums off for that engine side; nothing raises
into vLLM. Used by the plugin's hooks and by the series' call sites alike."""

import contextlib
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


def disable_after_error(owner: Any, attr: str, where: str) -> None:
    """Log one error with the traceback and set `owner.attr` (a scheduler's
    `kv_checksum_scheduler`, an ActiveKVConnector's `kv_checksum_worker`) to
    None, so the calls pass that object by from now on, and `close()` it
    if it has one. Call from an `except` block."""
    logger.exception(
        "KV checksums disabled for this engine after an error in %s; vLLM "
        "goes on without them.",
        where,
    )
    with contextlib.suppress(Exception):
        disabled = getattr(owner, attr, None)
        setattr(owner, attr, None)
        close = getattr(disabled, "close", None)
        if close is not None:
            close()  # the state kept beside it stops too


class KVChecksumGuard:
    """`with KVChecksumGuard(owner, attr, where):` around checksum code: an
    Exception is logged once and `disable(owner, attr, where)` (default:
    `disable_after_error`) turns checksums off for `owner`; nothing is raised.

    A plain class, not a generator context manager: it is entered every
    engine step, and this costs a fraction of a generator's set-up (R142).
    """

    __slots__ = ("owner", "attr", "where", "disable")

    def __init__(
        self,
        owner: Any,
        attr: str,
        where: str,
        disable: Callable[[Any, str, str], None] | None = None,
    ) -> None:
        self.owner = owner
        self.attr = attr
        self.where = where
        self.disable = disable

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False  # BaseExceptions (KeyboardInterrupt, SystemExit) pass
        (self.disable or disable_after_error)(self.owner, self.attr, self.where)
        return True
