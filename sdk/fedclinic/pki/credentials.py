"""A service's own TLS credentials, followed on disk so certificates rotate without a restart.

:class:`WatchedCredentials` holds the certificate, key and CA a process uses and re-reads them when one of
the three files changes (its mtime, size or inode: ``os.replace`` of a renewed file, a Kubernetes Secret
update). A new set is used only if it checks out (:func:`fedclinic.pki.check_own_certificate`: the key is
the certificate's, the CA issued it, it is valid now, the role is right); otherwise the previous set stays in
use and the reason is logged once per change. So a renewal that writes the key first and the certificate
second (``fedclinic pki renew`` / ``install``) is picked up when both are in place, never in between.

:func:`reloading_server_credentials` gives gRPC server credentials that ask for the current set at every new
TLS handshake (``grpc.dynamic_ssl_server_credentials``): new connections get the new certificate, open
connections keep the one they were made with.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import grpc
import structlog

from fedclinic.errors import FedclinicError
from fedclinic.pki.common import PeerIdentity
from fedclinic.pki.identity import identity_from_pem
from fedclinic.pki.preflight import check_own_certificate
from fedclinic.transport.rpc import TlsFiles

log = structlog.get_logger("fedclinic.credentials")

_Signature = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class Credentials:
    """One consistent set of PEM bytes and the identity in its certificate (None if it carries none)."""

    cert: bytes
    key: bytes
    ca: bytes
    identity: PeerIdentity | None


class WatchedCredentials:
    """The certificate, key and CA files of this process, re-read when they change (thread-safe).

    :attr:`current` is the set in use; :attr:`generation` counts the sets taken into use (0 for the one read
    at construction); :attr:`last_error` says why the latest change was not taken (None if it was)."""

    def __init__(self, tls: TlsFiles, *, role: str) -> None:
        self.tls = tls
        self.role = role
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self._seen = self._signature()
        cert, key, ca = tls.read()
        self.current = Credentials(cert, key, ca, _identity(cert))
        self.generation = 0

    def _signature(self) -> _Signature:
        out = []
        for path in (self.tls.cert, self.tls.key, self.tls.ca):
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
                continue
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def poll(self, *, force: bool = False) -> bool:
        """Look at the files (cheap: three ``stat`` calls unless something changed, or ``force``); take a
        changed set into use if it checks out. True if :attr:`current` changed."""
        with self._lock:
            before = self._signature()
            if before == self._seen and not force:
                return False
            try:
                ident = check_own_certificate(self.tls.cert, self.tls.key, self.tls.ca, expected_role=self.role,
                                              check_key_mode=False)
                cert, key, ca = self.tls.read()
            except FedclinicError as exc:
                if self._signature() != before:
                    return False  # changing under our feet: look again next time
                self._seen = before
                if self.last_error != str(exc):
                    log.warning("new TLS credentials not used; keeping the current ones", reason=str(exc),
                                cert=str(self.tls.cert))
                self.last_error = str(exc)
                return False
            if self._signature() != before:
                return False
            self._seen = before
            self.last_error = None
            if (cert, key, ca) == (self.current.cert, self.current.key, self.current.ca):
                return False
            old = self.current.identity
            self.current = Credentials(cert, key, ca, ident)
            self.generation += 1
        log.info("TLS credentials reloaded", cert=str(self.tls.cert), name=ident.name, role=ident.role,
                 serial=ident.serial_hex, previous_serial=old.serial_hex if old else None,
                 not_after=ident.not_after.isoformat())
        return True


def _identity(cert: bytes) -> PeerIdentity | None:
    try:
        return identity_from_pem(cert)
    except FedclinicError:
        return None


def reloading_server_credentials(watched: WatchedCredentials) -> grpc.ServerCredentials:
    """Server credentials requiring a client certificate from the CA, following ``watched``: at each new TLS
    handshake gRPC asks for the configuration, and gets the current set if it changed since it last got one
    (whoever noticed the change: the handshake itself, or a SIGHUP that polled first)."""
    delivered = [watched.generation]

    def configuration(c: Credentials) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(c.key, c.cert)], root_certificates=c.ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            watched.poll()
            if watched.generation == delivered[0]:
                return None
            delivered[0] = watched.generation
            return configuration(watched.current)
        except Exception:  # a failing fetcher would fail the handshake; keep serving with what gRPC has
            log.exception("reading the TLS credentials failed; keeping the current ones")
            return None

    return grpc.dynamic_ssl_server_credentials(configuration(watched.current), fetch,
                                               require_client_authentication=True)
