"""The scientist client's channel to the aggregator, over one or several addresses (a hot-standby pair).

With several addresses (``connect("a:7443,b:7443")`` or a list; fedclinic.transport.addresses), a call that fails
with UNAVAILABLE (a standby refusing, nobody listening, a connection cut) is tried again at the next address:
0.2 s between the addresses of one cycle, then 1, 2, 4, 8, 8 s after each full cycle, :data:`CYCLES` cycles in
all; then the last error is raised. Retried calls are safe to repeat: reads, a cancel, and a submission (its
idempotency key returns the task the first attempt created). With one address nothing is retried here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from fedclinic.proto import control_pb2, control_pb2_grpc
from fedclinic.transport.addresses import AddressRing, parse_addresses
from fedclinic.transport.rpc import TlsFiles, secure_channel

T = TypeVar("T")
#: full cycles over the addresses before a call gives up (about 25 s: longer than a standby's takeover)
CYCLES = 6
BETWEEN_ADDRESSES_S = 0.2


class ControlChannel:
    """The channel to the address in use; :meth:`retrying` runs a call with failover (module docstring)."""

    def __init__(self, address: str | Sequence[str], tls: TlsFiles, *, server_name: str | None = None,
                 stub_type: Callable[[grpc.Channel], Any] = control_pb2_grpc.ControlStub) -> None:
        """``stub_type``: the stub :attr:`stub` is (a site's records use the AgentService stub)."""
        self._stub_type = stub_type
        self.ring = AddressRing(parse_addresses(address, "aggregator address"))
        self._tls = tls
        self._server_name = server_name
        self._build()

    @property
    def address(self) -> str:
        """The address in use."""
        return self.ring.current

    def _build(self) -> None:
        self.channel = secure_channel(self.ring.current, self._tls, server_name=self._server_name)
        self.stub = self._stub_type(self.channel)
        self.submit_raw = self.channel.stream_unary("/fedclinic.v1.Control/SubmitTask", request_serializer=None,
                                                    response_deserializer=control_pb2.TaskStatus.FromString)

    def failover(self) -> bool:
        """Move to the next address; True when that wrapped round to the first."""
        wrapped = self.ring.advance()
        self.channel.close()
        self._build()
        return wrapped

    def pause_after_unavailable(self, cycle: int) -> int | None:
        """After an UNAVAILABLE: move to the next address and wait; returns the new cycle count, or None when the
        caller should give up (one address, or :data:`CYCLES` full cycles done)."""
        if len(self.ring.addresses) == 1:
            return None
        if self.failover():
            cycle += 1
            if cycle >= CYCLES:
                return None
            time.sleep(min(2 ** (cycle - 1), 8))
        else:
            time.sleep(BETWEEN_ADDRESSES_S)
        return cycle

    def retrying(self, call: Callable[[], T]) -> T:
        """``call()`` (which takes the stub from this channel each time), moved to the next address on
        UNAVAILABLE; raises the last grpc.RpcError."""
        cycle = 0
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                nxt = self.pause_after_unavailable(cycle)
                if nxt is None:
                    raise
                cycle = nxt

    def close(self) -> None:
        self.channel.close()

