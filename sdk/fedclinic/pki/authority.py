"""The CA folder: create it (:func:`init_ca`), open it, and keep its registry of issued certificates."""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedclinic.pki.common import (
    CA_CERT,
    CA_KEY,
    CLOCK_SKEW,
    CRL_DAYS,
    CRL_FILE,
    PkiError,
    REGISTRY,
    _REASONS,
    _ca_lock,
    _load_cert,
    _load_key,
    _mkdir,
    _now,
    _parse_time,
    _pem_private_key,
    _spki,
    _write_atomic,
)


@dataclass
class _Ca:
    dir: Path
    key: Any
    cert: x509.Certificate


def _no_ca_hint(ca_dir: Path) -> str:
    return f"create one with `fedclinic pki init-ca --ca-dir {ca_dir}` or pass the right --ca-dir"


def _load_ca(ca_dir: Path) -> _Ca:
    ca_dir = Path(ca_dir)
    if not (ca_dir / CA_CERT).exists() or not (ca_dir / CA_KEY).exists():
        raise PkiError(f"{ca_dir} is not a fedclinic CA folder (no {CA_CERT} and {CA_KEY}); {_no_ca_hint(ca_dir)}")
    cert = _load_cert(ca_dir / CA_CERT, "CA certificate", _no_ca_hint(ca_dir))
    key = _load_key(ca_dir / CA_KEY, "CA private key")
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise PkiError(f"{ca_dir / CA_KEY} does not belong to {ca_dir / CA_CERT}; restore the matching pair "
                       "from your backup of the CA folder")
    return _Ca(ca_dir, key, cert)


def _empty_registry() -> dict[str, Any]:
    return {"version": 1, "crl_number": 0, "certificates": []}


def _load_registry(ca_dir: Path) -> dict[str, Any]:
    path = Path(ca_dir) / REGISTRY
    if not path.exists():
        return _empty_registry()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PkiError(f"cannot read the certificate registry {path} ({exc}); restore it from your backup of "
                       "the CA folder") from None
    if not isinstance(data, dict) or not isinstance(data.get("certificates"), list):
        raise PkiError(f"the certificate registry {path} is not in the fedclinic format; restore it from your "
                       "backup of the CA folder")
    data.setdefault("crl_number", 0)
    return data


def _save_registry(ca_dir: Path, registry: dict[str, Any]) -> None:
    text = json.dumps(registry, indent=2, sort_keys=True) + "\n"
    _write_atomic(Path(ca_dir) / REGISTRY, text.encode("utf-8"), 0o644)


def _crl_number_on_disk(path: Path) -> int:
    """The CRL number of the CRL at ``path`` (0 if there is none, it is unreadable or has no number)."""
    try:
        data = path.read_bytes()
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return 0


def _write_crl(ca: _Ca, registry: dict[str, Any], now: dt.datetime, days: int = CRL_DAYS) -> None:
    """Sign and write ``crl.pem`` listing every revoked serial in ``registry``, with a CRL number above both the
    registry's and the one of the ``crl.pem`` it replaces (a registry restored from an older backup must not
    issue a CRL that services would refuse as older than the one they use)."""
    registry["crl_number"] = max(int(registry.get("crl_number", 0)), _crl_number_on_disk(ca.dir / CRL_FILE)) + 1
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now - CLOCK_SKEW)
        .next_update(now + dt.timedelta(days=days))
        .add_extension(x509.CRLNumber(registry["crl_number"]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    for rec in registry["certificates"]:
        if not rec.get("revoked_at"):
            continue
        entry = (x509.RevokedCertificateBuilder()
                 .serial_number(int(rec["serial"], 16))
                 .revocation_date(_parse_time(rec["revoked_at"])))
        reason = _REASONS.get(str(rec.get("reason") or "unspecified"), x509.ReasonFlags.unspecified)
        if reason is not x509.ReasonFlags.unspecified:  # RFC 5280 5.3.1: omit the code for "unspecified"
            entry = entry.add_extension(x509.CRLReason(reason), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
    crl = builder.sign(ca.key, hashes.SHA256())
    _write_atomic(ca.dir / CRL_FILE, crl.public_bytes(serialization.Encoding.PEM), 0o644)


def init_ca(ca_dir: str | os.PathLike[str], *, common_name: str = "fedclinic CA", days: int = 3650) -> Path:
    """Create a new fedclinic CA in ``ca_dir`` and return the path of its ``ca.crt``.

    Writes ``ca.key`` (ECDSA P-256, PKCS#8 PEM, mode 0600), ``ca.crt`` (self-signed, valid ``days`` days,
    BasicConstraints(ca=True, path_length=0) and KeyUsage(keyCertSign, cRLSign, digitalSignature), both
    critical, SubjectKeyIdentifier), an empty ``crl.pem`` (next update in 7 days) and an empty
    ``issued.json``. The folder is created with mode 0700 if needed.

    Raises :class:`PkiError` if ``ca_dir`` already holds a CA (it is never overwritten), or on bad input.
    """
    ca_dir = Path(ca_dir)
    if days < 1:
        raise PkiError(f"--days must be at least 1 (got {days}); a CA is typically valid for 3650 days")
    if not common_name or not common_name.strip():
        raise PkiError("the CA common name is empty; give one with --name, for example 'Hospital network CA'")
    _mkdir(ca_dir)
    with _ca_lock(ca_dir):
        existing = [n for n in (CA_KEY, CA_CERT) if (ca_dir / n).exists()]
        if existing:
            raise PkiError(f"{ca_dir} already holds a CA ({', '.join(existing)}); refusing to overwrite it. "
                           "Use another --ca-dir, or move the old CA folder away first if you really mean to "
                           "replace it (every certificate it issued will stop working)")
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                             x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedclinic")])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write_atomic(ca_dir / CA_KEY, _pem_private_key(key), 0o600)
        _write_atomic(ca_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        registry = _empty_registry()
        _write_crl(_Ca(ca_dir, key, cert), registry, now)
        _save_registry(ca_dir, registry)
    return ca_dir / CA_CERT
