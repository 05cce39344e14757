# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hybrid (Mamba / GDN) state: its checksum views and TP split descriptions."""
