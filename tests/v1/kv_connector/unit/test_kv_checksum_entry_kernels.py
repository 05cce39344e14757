# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block table's entry writes and moves (R117, R118) against an
independent reference (`kv_checksum_entry_cases.py`). The same checks run on
a GPU in test_kv_checksum_worker_cuda.py.

Bugs caught: the tag XORed before the columns are summed or not at all, a
column left out of the sum (width > 1), the slot copy writing the table's old
entry, a gather that writes at the source index instead of in order."""

import pytest

from tests.v1.kv_connector.unit.kv_checksum_entry_cases import check_entry_kernels

pytestmark = pytest.mark.cpu
entry_kernels = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels"
)


def test_R117_entry_writes_and_moves_match_the_reference() -> None:
    """Writes over 1-3 columns that wrap, with and without the slot copy, and
    gathers and scatters, on CPU tensors."""
    check_entry_kernels(entry_kernels.EntryKernels(), "cpu")
