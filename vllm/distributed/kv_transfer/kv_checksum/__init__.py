# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end checksums of the KV cache moved between P/D disaggregated instances.

See docs/features/kv_checksum.md. The package is wired into vLLM by the general
plugin in :mod:`.plugin`; the other modules are plain classes and functions.
"""
