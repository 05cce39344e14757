# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Inside vLLM's processes: the scheduler side, the worker side, the blocks
they track, containment of failed loads and the metrics."""
