# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What travels between instances: the payload, the outbox that holds it
until its carrier ships it, and its verification against what arrived."""
