# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Calls kept back while the engine thread still has device work in a step.

A connector that hands its block copies to a background thread (vLLM 0.33.0's
SimpleCPUOffloadConnector: one `cuMemcpyBatchAsync` over every block and layer
a batch) keeps the CUDA driver busy for milliseconds after each hand-off, and
every device call the engine thread makes meanwhile waits for it (issue 30:
5-6 ms a call on an H200 beside a copy, 0.1-0.5 ms alone). `HeldCalls` keeps
a step's hand-offs back until the checksum work of that step is queued, then
makes them in their order; the copies start a fraction of a millisecond later
and nothing of the engine thread waits on them.
"""

from collections.abc import Callable
from typing import Any


class HeldCalls:
    """A callable standing for `call`: while held, each call is kept (its
    arguments, in order); `release` makes the kept calls and stops holding.
    Not held, a call goes straight through. It holds only once armed, by the
    code that is sure to release it: kept calls never released would be
    copies never made."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call
        self.armed = False
        self.holding = False
        self._kept: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.holding:
            self._kept.append((args, kwargs))
        else:
            self.call(*args, **kwargs)

    def arm(self) -> None:
        """From now on `hold` holds (its caller releases every hold)."""
        self.armed = True

    def disarm(self) -> None:
        """From now on `hold` does not hold (checksums went off); calls kept
        already still wait for `release`."""
        self.armed = False

    def hold(self) -> None:
        """Keep the calls from now until `release`, once armed."""
        self.holding = self.armed

    def release(self) -> None:
        """Make the kept calls, in order, and stop holding. A kept call that
        raises does not keep the later ones back (each is a different copy);
        the first error is raised after all were made."""
        self.holding = False
        if not self._kept:
            return
        kept, self._kept = self._kept, []
        error: BaseException | None = None
        for args, kwargs in kept:
            try:
                self.call(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error
