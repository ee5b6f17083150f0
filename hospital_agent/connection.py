"""The agent's channel to the aggregator, rebuilt when the site's certificate or key is renewed on disk.

Every call takes its stub from :meth:`AgentChannel.stub` (or the raw upload callable from
:meth:`AgentChannel.submit_update`), which first looks at the certificate, key and CA files
(fedclinic.pki.credentials.WatchedCredentials: three ``stat`` calls). When a renewed, valid pair is in place
the next call goes out on a new channel with it; calls already running on the old channel (an upload, a
model download, a secure-aggregation answer) finish on it. The old channel is closed when the channel after
it replaces it, or when the agent stops. ``on_change`` callbacks run after each switch: the worker restarts
its WatchWork stream on the new channel and sends what its outbox holds. Nothing the agent keeps on disk
depends on the channel.

Several aggregator addresses (``"a:7443,b:7443"``: a hot-standby pair) are tried in turn: :meth:`AgentChannel.failover`
moves the next calls to the next address (the worker calls it when a call fails with UNAVAILABLE: a standby, or
nobody listening) and restarts the work stream there, as a credentials switch does.
"""

from __future__ import annotations

import threading
from typing import Callable

import grpc

from fedclinic.pki.credentials import WatchedCredentials
from fedclinic.transport.addresses import AddressRing, parse_addresses
from fedclinic.proto import agent_pb2, agent_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel_pem


class AgentChannel:
    def __init__(self, address: str, tls: TlsFiles, *, server_name: str | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        #: the aggregator addresses (comma-separated in ``address``), the one in use first
        self.ring = AddressRing(parse_addresses(address, "aggregator"))
        self.server_name = server_name
        self.credentials = WatchedCredentials(tls, role="agent")
        self._on_change = on_change
        self._lock = threading.Lock()
        self._retired: grpc.Channel | None = None
        self._build()

    @property
    def address(self) -> str:
        """The aggregator address the next call goes to."""
        return self.ring.current

    def _build(self) -> None:
        c = self.credentials.current
        self.channel = secure_channel_pem(self.address, c.cert, c.key, c.ca, server_name=self.server_name)
        self._stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self._submit_update = self.channel.stream_unary(  # takes pre-serialized UpdateChunk bytes
            "/fedclinic.v1.AgentService/SubmitUpdate", request_serializer=None,
            response_deserializer=agent_pb2.UpdateReceipt.FromString)
        self.generation = self.credentials.generation

    def refresh(self, *, force: bool = False) -> bool:
        """Switch to a new channel if renewed credentials are in place (``force``: re-read the files even if
        they look unchanged, e.g. on SIGHUP). True if it switched."""
        self.credentials.poll(force=force)
        with self._lock:
            if self.credentials.generation == self.generation:
                return False
            if self._retired is not None:
                self._retired.close()
            self._retired = self.channel
            self._build()
        if self._on_change is not None:
            self._on_change()
        return True

    def failover(self) -> bool:
        """Send the next calls to the next aggregator address (nothing to do with one address). True when every
        address has now been tried once since the first (the caller backs off longer then)."""
        if len(self.ring.addresses) == 1:
            return True
        with self._lock:
            wrapped = self.ring.advance()
            if self._retired is not None:
                self._retired.close()
            self._retired = self.channel
            self._build()
        return wrapped

    def stub(self) -> agent_pb2_grpc.AgentServiceStub:
        self.refresh()
        return self._stub

    def submit_update(self):
        """The SubmitUpdate stream-unary callable taking serialized ``UpdateChunk`` messages."""
        self.refresh()
        return self._submit_update

    def close(self) -> None:
        with self._lock:
            for channel in (self._retired, self.channel):
                if channel is not None:
                    channel.close()
            self._retired = None
