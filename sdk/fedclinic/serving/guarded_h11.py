"""uvicorn's h11 HTTP/1.1 protocol with the guards ``fedclinic serve`` needs and uvicorn does not have.

uvicorn (0.54) arms no timer while it waits for a request's headers: its keep-alive timer starts only after a
response and any byte received cancels it. A client that connects and sends nothing, or trickles its headers a
byte at a time (slowloris), holds its connection forever, and every such connection counts against
``limit_concurrency``, so a few hundred of them would turn every honest request into a 503.
:class:`GuardedH11Protocol` adds:

- a **header deadline**: the request line and all headers must arrive within ``header_timeout`` seconds of the
  connection being made (or of the previous response on a kept-alive connection), however slowly the bytes
  trickle; otherwise the connection is closed. The body has its own deadline in the app (``--body-timeout``).
- a JSON ``400`` for a request h11 refuses (a negative or non-numeric Content-Length, a malformed request
  line or header), in the service's ``{"error": ...}`` form, and the connection closed;
- an answer to a client that half-closes its side after sending a complete request (``nc -N``, some proxies):
  uvicorn closes the connection on end-of-file without answering; a complete request is now answered and the
  connection closed after the response, an incomplete one gets the 400 of a cut request;
- the client certificate of an HTTPS connection in the request scope (the ASGI TLS extension,
  ``scope["extensions"]["tls"]["client_cert_chain"]``), so the app can check the certificate's role.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    """Set ``header_timeout`` with :meth:`with_header_timeout` (uvicorn builds one protocol per connection)."""

    header_timeout: float = 10.0

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[GuardedH11Protocol]:
        """This protocol with a header deadline of ``seconds``."""
        if not seconds > 0:
            raise ValueError(f"the header timeout must be > 0 seconds, got {seconds!r}")
        return type(cls.__name__, (cls,), {"header_timeout": float(seconds)})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._tls_extension: dict[str, Any] | None = None
        self._peer_eof = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object: ssl.SSLObject | None = transport.get_extra_info("ssl_object")
        if ssl_object is not None:  # asyncio calls this after the TLS handshake: the peer is verified
            der = ssl_object.getpeercert(binary_form=True)
            chain = [ssl.DER_cert_to_PEM_cert(der)] if der else []
            self._tls_extension = {"client_cert_chain": chain, "tls_version": None, "cipher_suite": None}
        self._arm_header_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in: the app's deadlines apply
            self._cancel_header_deadline()
            if self._tls_extension is not None and self.scope is not None:
                self.scope.setdefault("extensions", {})["tls"] = self._tls_extension  # type: ignore[typeddict-unknown-key]

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client will send nothing more. Nothing to answer (no request begun): close. A complete request:
        keep the transport open to write its response, then close (:meth:`on_response_complete`). A request cut
        in its headers or body: h11 sees the end and refuses it (:meth:`send_400_response`)."""
        self._peer_eof = True
        state = self.conn.their_state
        if state in (h11.DONE, h11.MUST_CLOSE):  # MUST_CLOSE: a complete request with "Connection: close"
            return True  # the response is being made; asyncio keeps the write side open (ignored under TLS)
        cut = state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0])
        if not cut:
            return None  # no byte of a request (or a closed/failed connection): asyncio closes the transport
        # h11 sees the end of a cut request and refuses it (RemoteProtocolError: a 400, the transport closed).
        # Never feed the end in another state: h11 would then return ConnectionClosed, which uvicorn's event
        # loop does not handle (it would spin).
        self.conn.receive_data(b"")
        self.handle_events()
        return None

    def on_response_complete(self) -> None:
        if self._peer_eof:
            self.server_state.total_requests += 1
            self.transport.close()
            return
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: answer a JSON 400 that says why, then close (its framing is unknown)."""
        self._cancel_header_deadline()
        body = json.dumps({"error": "invalid HTTP/1.1 request (a malformed request line or header, or a Content-Length "
                                    "that is not a non-negative decimal number); send a well-formed request with a "
                                    "valid Content-Length or chunked Transfer-Encoding"}).encode()
        try:
            for event in (h11.Response(status_code=400, reason=b"Bad Request",
                                       headers=[(b"content-type", b"application/json"), (b"connection", b"close"),
                                                (b"content-length", str(len(body)).encode())]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # h11 cannot frame a response in this state: closing is the answer
        if self.cycle is not None:  # a request the app is handling (its body was cut): it must not answer too,
            self.cycle.disconnected = True  # before the transport's close reaches connection_lost (found by the
            self.cycle.message_event.set()  # fuzz campaign: h11 LocalProtocolError in state MUST_CLOSE)
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
