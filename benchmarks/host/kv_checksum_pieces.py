# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The --compare benchmarks' reference: the package's own code with only the
pieces a rework changed swapped back for their old versions (issue 30)."""

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock

# (owner, name looked up at call time, the old version)
Piece = tuple[Any, str, Any]


@contextlib.contextmanager
def swapped(pieces: Iterable[Piece]) -> Iterator[None]:
    """Every piece's old version in place while inside; the package's again
    on exit (also on an exception)."""
    with contextlib.ExitStack() as stack:
        for owner, name, old in pieces:
            stack.enter_context(mock.patch.object(owner, name, old))
        yield
