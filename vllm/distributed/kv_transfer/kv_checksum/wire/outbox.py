# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A producer scheduler's CONNECTOR payloads on their way to its workers.

NIXL push (R104) and Mooncake (R111) ship a finished request's payload in the
connector metadata that also ships its blocks. `send_kv_checksums` runs right
after the connector's `request_finished`, so the outbox keeps bytes only for a
request that call just queued for sending and drops every other one (aborted,
nothing to send): nothing outlives the next metadata.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class ChecksumOutbox:
    """Payloads waiting for the next connector metadata."""

    pending: dict[str, bytes] = field(default_factory=dict)

    def keep(self, req_id: str, data: bytes, about_to_send: bool) -> None:
        """Keep bytes only for a request whose blocks are about to be sent."""
        if about_to_send:
            self.pending[req_id] = bytes(data)

    def ship(self, sent: Iterable[str]) -> dict[str, bytes]:
        """The payloads of the requests shipped now; everything else goes."""
        shipped = {
            req_id: self.pending[req_id] for req_id in sent if req_id in self.pending
        }
        self.pending.clear()
        return shipped
