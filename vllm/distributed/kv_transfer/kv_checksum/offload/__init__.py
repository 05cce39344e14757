# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU offload tier: checksum entries that travel with offloaded blocks,
verification of host loads, both CPU offload connectors and host faults."""
