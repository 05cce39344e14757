# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a KV connector carries a request's KV checksums to the consumer."""

import enum

KV_TRANSFER_PARAMS_KEY = "kv_checksums"
"""The kv_transfer_params key holding a request's checksums when its
connector declares `KVChecksumCarrier.KV_TRANSFER_PARAMS`."""


class KVChecksumCarrier(enum.Enum):
    """The way a connector moves the producer's checksums of a request.

    Declared per request by `KVConnectorBase_V1.kv_checksum_carrier`; a
    connector that declares none for a request moves no checksums with its
    KV, so a load of it cannot be verified.
    """

    KV_TRANSFER_PARAMS = "kv_transfer_params"
    """The checksums travel in the request's kv_transfer_params, which the
    proxy already forwards from producer to consumer with the block ids (pull
    connectors): the connector's own messages are unchanged."""

    CONNECTOR = "connector"
    """The connector moves the checksum bytes in its own messages, for
    connectors whose consumer never sees the producer's kv_transfer_params
    (push connectors, transfer engines)."""
