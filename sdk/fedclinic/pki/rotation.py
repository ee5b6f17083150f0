"""Rotation: install a new key and certificate over the ones a running service uses (:func:`install_credentials`, :func:`renew`)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography import x509

from fedclinic.pki.common import (
    IssuedCert,
    PeerIdentity,
    PkiError,
    _issue_hint,
    _load_cert,
    _mkdir,
    _read_bytes,
    _verify_issued_by,
    _write_atomic,
)
from fedclinic.pki.authority import _load_ca
from fedclinic.pki.leaf import issue
from fedclinic.pki.revocation import revoke
from fedclinic.pki.identity import _identity
from fedclinic.pki.preflight import check_own_certificate


def install_credentials(
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    ca_path: str | os.PathLike[str],
    *,
    to_cert: str | os.PathLike[str],
    to_key: str | os.PathLike[str],
    expected_role: str | None = None,
) -> PeerIdentity:
    """Check a new certificate and key (:func:`check_own_certificate`: the pair matches, issued by the CA in
    ``ca_path``, valid now, role ``expected_role`` when given) and put them in place of ``to_cert`` /
    ``to_key``: the key first (mode 0600), then the certificate, each replaced atomically. A running aggregator
    or agent watches those files and switches to the new pair once both have changed (it ignores the moment
    in between, when key and certificate do not match). Nothing is replaced if the check fails."""
    ident = check_own_certificate(cert_path, key_path, ca_path, expected_role=expected_role)
    to_cert, to_key = Path(to_cert), Path(to_key)
    if to_cert.resolve() == Path(cert_path).resolve() or to_key.resolve() == Path(key_path).resolve():
        raise PkiError("the new certificate and key must be different files from the ones they replace")
    for target in (to_cert, to_key):
        if not target.parent.is_dir():
            raise PkiError(f"the folder {target.parent} does not exist; give the paths of the files the service uses")
    cert_pem = _read_bytes(Path(cert_path), "certificate", "check the path")
    key_pem = _read_bytes(Path(key_path), "private key", "check the path")
    _write_atomic(to_key, key_pem, 0o600)
    _write_atomic(to_cert, cert_pem, 0o644)
    return ident


def renew(
    ca_dir: str | os.PathLike[str],
    *,
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str] | None = None,
    days: int = 30,
    revoke_old: bool = False,
) -> IssuedCert:
    """Renew the certificate in ``cert_path`` in place: a new P-256 key is made in the folder of ``key_path``
    (default: ``cert_path`` with ``.key``), a new certificate with the same role, name and DNS/IP names is
    issued by the CA in ``ca_dir`` for ``days`` days, and both are installed with :func:`install_credentials`
    (key first, then certificate). With ``revoke_old`` the old certificate is then revoked as ``superseded``
    (do this once the service has picked up the new one: its open connections still use the old).

    For a CA kept elsewhere, the same rotation is ``fedclinic pki request`` (new key made on the site, into a
    staging folder), ``fedclinic pki issue --csr`` at the CA, then ``fedclinic pki install``."""
    cert_path = Path(cert_path)
    key_path = Path(key_path) if key_path is not None else cert_path.with_suffix(".key")
    old = _load_cert(cert_path, "certificate", "give the certificate file the service uses")
    ident = _identity(old)
    ca = _load_ca(Path(ca_dir))
    if not _verify_issued_by(old, ca.cert):
        raise PkiError(f"{cert_path} was not issued by the CA in {ca_dir}; renew it with the CA that issued it, or "
                       f"{_issue_hint(ident.role, ident.name)}")
    try:
        san = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = san.get_values_for_type(x509.DNSName), san.get_values_for_type(x509.IPAddress)
    except x509.ExtensionNotFound:
        dns, ips = [], []
    staging = _mkdir(key_path.parent / f".renew-{secrets.token_hex(4)}")
    try:
        new = issue(ca_dir, role=ident.role, name=ident.name, out_dir=staging, days=days, dns=dns, ips=ips)
        assert new.key_path is not None
        install_credentials(new.cert_path, new.key_path, new.ca_path, to_cert=cert_path, to_key=key_path,
                            expected_role=ident.role)
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    if revoke_old:
        revoke(ca_dir, serial_hex=ident.serial_hex, reason="superseded")
    return IssuedCert(name=new.name, role=new.role, serial_hex=new.serial_hex, cert_path=cert_path, key_path=key_path,
                      ca_path=new.ca_path, not_after=new.not_after, fingerprint_sha256=new.fingerprint_sha256)
