"""The revocation list a service checks per call (:class:`RevocationList`), reloaded when ``crl.pem`` changes.

Revocation never goes backwards: a CRL older than the one in use (by CRL number, then thisUpdate) is refused, and
with a high-water file (the aggregator keeps one in its state folder) so is an old CRL copied in across a restart.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm

from fedclinic.pki.common import (
    PkiError,
    _load_cert,
    _norm_serial,
    _now,
    _read_bytes,
    _serial_hex,
    _spki,
    _write_atomic,
    log,
)


@dataclass(frozen=True)
class CrlVersion:
    """Where a CRL stands in its CA's sequence: its CRL number (None if it has none) and its thisUpdate (UTC)."""

    number: int | None
    this_update: dt.datetime

    def older_than(self, other: "CrlVersion") -> bool:
        """True if this CRL was issued before ``other`` (the CRL number decides; thisUpdate when the numbers are
        equal or one is missing). Equal versions are not older: re-copying the CRL in use is harmless."""
        if self.number is not None and other.number is not None and self.number != other.number:
            return self.number < other.number
        return self.this_update < other.this_update

    def describe(self) -> str:
        number = "no CRL number" if self.number is None else f"CRL number {self.number}"
        return f"{number}, issued {self.this_update.isoformat()}"


def crl_version(crl: x509.CertificateRevocationList) -> CrlVersion:
    """The :class:`CrlVersion` of a loaded CRL."""
    try:
        number: int | None = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        number = None
    return CrlVersion(number, crl.last_update_utc)


def _older_message(path: Path, offered: CrlVersion, newest: CrlVersion, where: str) -> str:
    return (f"revocation list {path} is older than the one {where} ({offered.describe()}; {where}: "
            f"{newest.describe()}): an old CRL put back could re-admit revoked certificates, so it is refused. "
            "Copy the current crl.pem from the CA folder (`fedclinic pki refresh-crl --ca-dir CA_DIR` issues a newer "
            "one)")


class RevocationList:
    """The CA's revoked serials, loaded from ``crl_path`` and verified against the CA certificate.

    ``reload_if_changed()`` re-reads the file when its mtime, size or inode change (cheap enough to call on
    every RPC; thread-safe). A CRL that does not verify (not signed by the CA, damaged, missing after a
    good one was loaded) never replaces a good one: the old list is kept, the problem is logged once per
    change and kept in :attr:`last_error`. At construction there is no old list, so the same problems
    raise :class:`PkiError`.

    Revocation never goes backwards: a validly signed CRL that is older than the one in use (lower CRL number;
    same number and earlier thisUpdate) is refused with an error log naming both numbers, and the list in use stays
    in force. With ``high_water`` (a file; the aggregator uses ``STATE_DIR/crl-high-water.json``) the newest version
    ever loaded for this CA is remembered, and constructing from an older CRL raises :class:`PkiError`, so a restart
    with an old CRL copied in is refused too.

    A CRL whose next update has passed is still used (refusing every caller would be an outage);
    :attr:`stale` tells, and ``fedclinic pki revoke`` or :func:`refresh_crl` re-sign it.
    """

    def __init__(self, crl_path: str | os.PathLike[str], ca_cert_path: str | os.PathLike[str], *,
                 high_water: str | os.PathLike[str] | None = None) -> None:
        self.crl_path = Path(crl_path)
        self.ca_cert_path = Path(ca_cert_path)
        #: a JSON file remembering the newest CRL version ever used with this CA (None: not remembered across runs)
        self.high_water = Path(high_water) if high_water is not None else None
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self._ca = _load_cert(self.ca_cert_path, "CA certificate",
                              "give the ca.crt of the fedclinic CA that signs the revocation list")
        self._ca_key_id = hashlib.sha256(_spki(self._ca.public_key())).hexdigest()
        if not self.crl_path.exists():
            raise PkiError(f"revocation list {self.crl_path} does not exist; `fedclinic pki init-ca` writes one "
                           "(crl.pem in the CA folder) and `fedclinic pki revoke` updates it: copy it here, or "
                           "fix the CRL path in the configuration")
        sig = self._signature()
        serials, next_update, version = self._load()
        recorded = self._read_high_water()
        if recorded is not None and version.older_than(recorded):
            raise PkiError(_older_message(self.crl_path, version, recorded,
                                          f"already used (recorded in {self.high_water})"))
        self._serials: frozenset[str] = serials
        self._next_update = next_update
        self._version = version
        self._seen = sig
        self._loaded = sig
        if recorded is None or recorded.older_than(version):
            self._write_high_water(version)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.crl_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read_high_water(self) -> CrlVersion | None:
        """The newest version recorded for this CA, or None (no file, another CA's, or unreadable: logged)."""
        if self.high_water is None or not self.high_water.exists():
            return None
        try:
            doc = json.loads(self.high_water.read_text(encoding="utf-8"))
            if doc.get("ca_key_sha256") != self._ca_key_id:
                return None  # a new CA starts its own sequence
            number = doc.get("crl_number")
            return CrlVersion(None if number is None else int(number), dt.datetime.fromisoformat(doc["this_update"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("revocation high-water mark unreadable: an old CRL copied in would not be noticed until a "
                      "newer one is loaded", path=str(self.high_water), error=str(exc))
            return None

    def _write_high_water(self, version: CrlVersion) -> None:
        if self.high_water is None:
            return
        doc = {"ca_key_sha256": self._ca_key_id, "crl_number": version.number,
               "this_update": version.this_update.isoformat()}
        try:
            _write_atomic(self.high_water, (json.dumps(doc, sort_keys=True) + "\n").encode("utf-8"), 0o644)
        except PkiError as exc:
            log.error("revocation high-water mark not written", path=str(self.high_water), reason=str(exc))

    def _load(self) -> tuple[frozenset[str], dt.datetime | None, CrlVersion]:
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
        return frozenset(_serial_hex(r.serial_number) for r in crl), crl.next_update_utc, crl_version(crl)

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
                serials, next_update, version = self._load()
            except PkiError as exc:
                self.last_error = f"{exc} (still using the previous revocation list with {len(self._serials)} serials)"
                log.warning("revocation list not reloaded", path=str(self.crl_path), reason=self.last_error)
                return False
            if version.older_than(self._version):
                self.last_error = (f"{_older_message(self.crl_path, version, self._version, 'in use')} (still using "
                                   f"the revocation list in use, with {len(self._serials)} serials)")
                log.error("older revocation list refused", path=str(self.crl_path), offered_crl_number=version.number,
                          offered_this_update=version.this_update.isoformat(), in_use_crl_number=self._version.number,
                          in_use_this_update=self._version.this_update.isoformat(), revoked=len(self._serials),
                          reason=self.last_error)
                return False
            self._serials, self._next_update, self._version = serials, next_update, version
            self._loaded = sig
            self.last_error = None
            self._write_high_water(version)
            log.info("revocation list reloaded", path=str(self.crl_path), revoked=len(serials),
                     crl_number=version.number, next_update=next_update.isoformat() if next_update else None)
            return True

    def is_revoked(self, serial_hex: str) -> bool:
        """True if the certificate with this serial (hex, as in :class:`PeerIdentity`) is revoked."""
        return _norm_serial(serial_hex) in self._serials

    @property
    def serials(self) -> frozenset[str]:
        """The revoked serials (lowercase hex, no leading zeros)."""
        return self._serials

    @property
    def version(self) -> CrlVersion:
        """The CRL number and thisUpdate of the list in use."""
        return self._version

    @property
    def next_update(self) -> dt.datetime | None:
        """When the CA promised the next CRL (UTC)."""
        return self._next_update

    @property
    def stale(self) -> bool:
        """True if the loaded CRL's next update time has passed."""
        return self._next_update is not None and self._next_update < _now()
