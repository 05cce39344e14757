# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Connector-specific carriers of the payload: the carrier declaration API,
NIXL push and Mooncake."""
