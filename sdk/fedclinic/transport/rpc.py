"""gRPC plumbing shared by the SDK, the agent and the aggregator: mTLS credentials, keepalive and
message-size options, and translation of transport failures into errors that say what to do.

Keepalive: clients ping every 60 s (also without active calls) and the server accepts pings that often,
so a quiet WatchWork stream through a NAT or load balancer is not dropped while a site trains for hours.
Message sizes stay at gRPC's 4 MiB receive default: every large payload is chunked (see wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from fedclinic.errors import FedclinicError

KEEPALIVE_MS = 60_000
CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
]
SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class TlsFiles:
    """The three PEM files every fedclinic process needs: its certificate, its private key, the CA."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for label, path in (("certificate", self.cert), ("private key", self.key), ("CA certificate", self.ca)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise FedclinicError(f"cannot read the {label} {path}: {exc.strerror}; check the path in your "
                                     "configuration (create credentials with `fedclinic pki issue`)") from None
        return out[0], out[1], out[2]


def secure_channel(address: str, tls: TlsFiles, *, server_name: str | None = None) -> grpc.Channel:
    """An mTLS channel to ``address`` (host:port). ``server_name`` overrides the name checked in the
    server certificate (default: the host part of the address)."""
    cert, key, ca = tls.read()
    return secure_channel_pem(address, cert, key, ca, server_name=server_name)


def secure_channel_pem(address: str, cert: bytes, key: bytes, ca: bytes, *, server_name: str | None = None) -> grpc.Channel:
    """:func:`secure_channel` from PEM bytes already read (e.g. fedclinic.pki.credentials.WatchedCredentials)."""
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, creds, options=options)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by our CA on every connection."""
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def explain_rpc_error(exc: grpc.RpcError, address: str) -> FedclinicError:
    """Turn a gRPC failure into an error a person can act on."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        low = (details or "").lower()
        if "socket closed" in low:
            # TLS 1.3: when the server rejects our client certificate we only see the socket close.
            return FedclinicError(
                f"the aggregator at {address} closed the connection during the TLS handshake: it most likely "
                "refused this certificate (issued by another CA, expired, or not yet valid). Check it with "
                "`fedclinic pki list` / `hospital-agent check-config`; the aggregator log names the reason"
            )
        if "hostname verification" in low:
            host = address.rsplit(":", 1)[0]
            return FedclinicError(
                f"the aggregator at {address} answered with a certificate that does not name {host!r} (the "
                "TLS hostname check failed). Connect with a host name or IP address the certificate lists "
                "(`openssl x509 -noout -ext subjectAltName -in aggregator.crt`), or have the operator reissue it "
                f"with this one (`fedclinic pki issue --role aggregator ... --dns NAME --ip IP`). An agent can "
                "also set server_name in agent.toml to a name the certificate lists"
            )
        if "handshake" in low or "ssl" in low or "certificate" in low or "tls" in low:
            return FedclinicError(
                f"the TLS handshake with {address} failed ({details}). The aggregator refused this "
                "certificate or this side refused the aggregator's: check that both come from the same "
                "fedclinic CA, that neither has expired (`fedclinic pki list`), and that the address "
                "matches a name in the aggregator certificate"
            )
        return FedclinicError(f"cannot reach the aggregator at {address} ({details}); is it running and is "
                              "the address right?")
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return FedclinicError(f"the aggregator refused the call: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FedclinicError(f"the aggregator at {address} did not answer in time ({details})")
    return FedclinicError(f"{code.name if code else 'error'}: {details}")
