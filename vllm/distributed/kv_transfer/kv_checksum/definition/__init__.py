# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a checksum is: the definition, its records, the kernels, the
views of KV caches and the rows to checksum."""
