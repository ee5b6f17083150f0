"""The revocation list a service checks per call (:class:`RevocationList`), reloaded when ``crl.pem`` changes."""

from __future__ import annotations

import datetime as dt
import os
import threading
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm

from fedclinic.pki.common import PkiError, _load_cert, _norm_serial, _now, _read_bytes, _serial_hex, log


class RevocationList:
    """The CA's revoked serials, loaded from ``crl_path`` and verified against the CA certificate.

    ``reload_if_changed()`` re-reads the file when its mtime, size or inode change (cheap enough to call on
    every RPC; thread-safe). A CRL that does not verify (not signed by the CA, damaged, missing after a
    good one was loaded) never replaces a good one: the old list is kept, the problem is logged once per
    change and kept in :attr:`last_error`. At construction there is no old list, so the same problems
    raise :class:`PkiError`.

    A CRL whose next update has passed is still used (refusing every caller would be an outage);
    :attr:`stale` tells, and ``fedclinic pki revoke`` or :func:`refresh_crl` re-sign it.
    """

    def __init__(self, crl_path: str | os.PathLike[str], ca_cert_path: str | os.PathLike[str]) -> None:
        self.crl_path = Path(crl_path)
        self.ca_cert_path = Path(ca_cert_path)
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self._ca = _load_cert(self.ca_cert_path, "CA certificate",
                              "give the ca.crt of the fedclinic CA that signs the revocation list")
        if not self.crl_path.exists():
            raise PkiError(f"revocation list {self.crl_path} does not exist; `fedclinic pki init-ca` writes one "
                           "(crl.pem in the CA folder) and `fedclinic pki revoke` updates it: copy it here, or "
                           "fix the CRL path in the configuration")
        sig = self._signature()
        serials, next_update = self._load()
        self._serials: frozenset[str] = serials
        self._next_update = next_update
        self._seen = sig
        self._loaded = sig

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.crl_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self) -> tuple[frozenset[str], dt.datetime | None]:
        data = _read_bytes(self.crl_path, "revocation list",
                           "copy crl.pem from the CA folder (`fedclinic pki init-ca` writes one)")
        try:
            if b"-----BEGIN" in data:
                crl = x509.load_pem_x509_crl(data)
            else:
                crl = x509.load_der_x509_crl(data)
        except ValueError:
            raise PkiError(f"revocation list {self.crl_path} is not a valid CRL; copy crl.pem again from the CA "
                           "folder") from None
        try:
            valid = crl.issuer == self._ca.subject and crl.is_signature_valid(self._ca.public_key())
        except (TypeError, UnsupportedAlgorithm):
            valid = False
        if not valid:
            raise PkiError(f"revocation list {self.crl_path} is not signed by the CA {self.ca_cert_path} "
                           f"(issuer {crl.issuer.rfc4514_string()}); copy crl.pem from the folder of the CA "
                           "that issued the certificates")
        return frozenset(_serial_hex(r.serial_number) for r in crl), crl.next_update_utc

    def reload_if_changed(self) -> bool:
        """Reload the CRL if the file changed since the last look; True if a new list is now in use.
        Never raises for a bad new file: the previous good list stays in use (see :attr:`last_error`)."""
        with self._lock:
            sig = self._signature()
            if sig == self._seen:
                return False
            self._seen = sig
            try:
                if sig is None:
                    raise PkiError(f"revocation list {self.crl_path} has disappeared; put crl.pem from the CA "
                                   "folder back")
                serials, next_update = self._load()
            except PkiError as exc:
                self.last_error = f"{exc} (still using the previous revocation list with {len(self._serials)} serials)"
                log.warning("revocation list not reloaded", path=str(self.crl_path), reason=self.last_error)
                return False
            self._serials, self._next_update = serials, next_update
            self._loaded = sig
            self.last_error = None
            log.info("revocation list reloaded", path=str(self.crl_path), revoked=len(serials),
                     next_update=next_update.isoformat() if next_update else None)
            return True

    def is_revoked(self, serial_hex: str) -> bool:
        """True if the certificate with this serial (hex, as in :class:`PeerIdentity`) is revoked."""
        return _norm_serial(serial_hex) in self._serials

    @property
    def serials(self) -> frozenset[str]:
        """The revoked serials (lowercase hex, no leading zeros)."""
        return self._serials

    @property
    def next_update(self) -> dt.datetime | None:
        """When the CA promised the next CRL (UTC)."""
        return self._next_update

    @property
    def stale(self) -> bool:
        """True if the loaded CRL's next update time has passed."""
        return self._next_update is not None and self._next_update < _now()
