"""Leaf certificates: issue a key and certificate (or sign a CSR) for a role and name, and make CSRs."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedclinic.pki.common import (
    CA_CERT,
    CA_KEY,
    CLOCK_SKEW,
    IssuedCert,
    PkiError,
    URI_SCHEME,
    _ca_lock,
    _check_key_type,
    _fingerprint,
    _fmt,
    _mkdir,
    _now,
    _pem_private_key,
    _read_bytes,
    _serial_hex,
    _utc,
    _validate_dns,
    _validate_ips,
    _write_atomic,
    validate_name,
    validate_role,
)
from fedclinic.pki.authority import _load_ca, _load_registry, _save_registry


def _san_list(role: str, name: str, dns: Sequence[str], ips: Sequence[Any]) -> list[x509.GeneralName]:
    dns_v = _validate_dns(dns)
    ips_v = _validate_ips(ips)
    if role == "aggregator" and not dns_v and not ips_v:
        dns_v, ips_v = ["localhost"], [ipaddress.ip_address("127.0.0.1")]
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"{URI_SCHEME}{role}/{name}")]
    sans += [x509.DNSName(d) for d in dict.fromkeys(dns_v)]
    sans += [x509.IPAddress(i) for i in dict.fromkeys(ips_v)]
    return sans


def _subject(role: str, name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedclinic"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                      x509.NameAttribute(NameOID.COMMON_NAME, name)])


def _load_csr(path: Path) -> x509.CertificateSigningRequest:
    data = _read_bytes(path, "certificate request", "make one with `fedclinic pki request` on the machine "
                       "that will use the certificate")
    try:
        if b"-----BEGIN" in data:
            return x509.load_pem_x509_csr(data)
        return x509.load_der_x509_csr(data)
    except ValueError:
        raise PkiError(f"{path} is not a certificate signing request (PEM or DER); make one with "
                       "`fedclinic pki request`") from None


def _csr_sans(csr: x509.CertificateSigningRequest) -> tuple[list[str], list[Any], list[str]]:
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], [], []
    return (san.get_values_for_type(x509.DNSName), san.get_values_for_type(x509.IPAddress),
            san.get_values_for_type(x509.UniformResourceIdentifier))


def issue(
    ca_dir: str | os.PathLike[str],
    *,
    role: str,
    name: str,
    out_dir: str | os.PathLike[str],
    days: int = 30,
    dns: Sequence[str] = (),
    ips: Sequence[Any] = (),
    csr_path: str | os.PathLike[str] | None = None,
    not_before: dt.datetime | None = None,
) -> IssuedCert:
    """Issue a certificate for ``role``/``name`` signed by the CA in ``ca_dir``; return what was written.

    Subject ``O=fedclinic, OU=<role>, CN=<name>``; SAN URI ``fedclinic://<role>/<name>`` plus the DNS and
    IP SANs given (an aggregator with none gets DNS ``localhost`` and IP ``127.0.0.1``);
    BasicConstraints(ca=False) and KeyUsage(digitalSignature), both critical; EKU serverAuth+clientAuth for
    the aggregator, clientAuth for the other roles; random serial; SHA-256; SKI/AKI.

    Without ``csr_path`` a new P-256 key is generated into ``out_dir/<name>.key`` (mode 0600). With
    ``csr_path`` the CSR's signature is verified, its CN must equal ``name`` (and a fedclinic SAN URI in it,
    if any, must name the same role and name), its DNS/IP SANs are used when ``dns``/``ips`` are empty, and
    no key is written. Either way ``out_dir/<name>.crt`` and a copy of the CA certificate
    ``out_dir/ca.crt`` are written, and the certificate is recorded in ``issued.json``.

    The certificate is valid from ``not_before`` (default: now minus 5 minutes of clock skew) until
    ``(not_before or now) + days``; ``not_before`` exists so tests can make expired and not-yet-valid
    certificates. A certificate never outlives its CA. ``out_dir`` must not be the CA folder.
    """
    validate_role(role)
    validate_name(name)
    if days < 1:
        raise PkiError(f"--days must be at least 1 (got {days}); fedclinic certificates are short-lived, "
                       "30 days is the default")
    ca_dir, out_dir = Path(ca_dir), Path(out_dir)
    ca = _load_ca(ca_dir)
    if out_dir.exists() and out_dir.resolve() == ca_dir.resolve():
        raise PkiError(f"--out {out_dir} is the CA folder; write certificates and keys to a separate folder "
                       "(the CA folder should hold only CA material)")

    now = _now()
    start = _utc(not_before) if not_before is not None else now - CLOCK_SKEW
    end = (start if not_before is not None else now) + dt.timedelta(days=days)
    ca_end = ca.cert.not_valid_after_utc
    if ca_end <= now:
        raise PkiError(f"the CA certificate {ca_dir / CA_CERT} expired on {_fmt(ca_end)}; create a new CA with "
                       "`fedclinic pki init-ca` and issue every certificate again")
    if end > ca_end:
        raise PkiError(f"a {days}-day certificate would end on {_fmt(end)}, after the CA itself expires "
                       f"({_fmt(ca_end)}); use fewer --days or create a new CA")

    key = None
    if csr_path is not None:
        csr = _load_csr(Path(csr_path))
        if not csr.is_signature_valid:
            raise PkiError(f"the signature of certificate request {csr_path} does not verify (the file is "
                           "damaged or was altered); make a new one with `fedclinic pki request`")
        cns = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if cns != [name]:
            raise PkiError(f"certificate request {csr_path} is for CN={', '.join(map(str, cns)) or '(none)'}, "
                           f"not {name!r}; check that you are signing the right request, or pass the name "
                           "it was made for with --name")
        csr_dns, csr_ips, csr_uris = _csr_sans(csr)
        want = f"{URI_SCHEME}{role}/{name}"
        for uri in csr_uris:
            if uri.startswith(URI_SCHEME) and uri != want:
                raise PkiError(f"certificate request {csr_path} asks for {uri}, but you are issuing {want}; "
                               "check --role and --name, or have the requester make a new request")
        public_key = csr.public_key()
        _check_key_type(public_key, f"certificate request {csr_path}")
        if not dns and not ips:
            dns, ips = csr_dns, csr_ips
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        public_key = key.public_key()

    eku = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role == "aggregator":
        eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_subject(role, name))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        .add_extension(x509.SubjectAlternativeName(_san_list(role, name, dns, ips)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )

    _mkdir(out_dir)
    key_path = None
    if key is not None:
        key_path = out_dir / f"{name}.key"
        _write_atomic(key_path, _pem_private_key(key), 0o600)
    cert_path = out_dir / f"{name}.crt"
    _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    ca_path = out_dir / CA_CERT
    _write_atomic(ca_path, ca.cert.public_bytes(serialization.Encoding.PEM), 0o644)

    serial = _serial_hex(cert.serial_number)
    fp = _fingerprint(cert)
    with _ca_lock(ca_dir):
        registry = _load_registry(ca_dir)
        registry["certificates"].append({
            "serial": serial, "name": name, "role": role,
            "not_before": _fmt(cert.not_valid_before_utc), "not_after": _fmt(cert.not_valid_after_utc),
            "fingerprint_sha256": fp, "revoked_at": None, "reason": None,
        })
        _save_registry(ca_dir, registry)
    return IssuedCert(name=name, role=role, serial_hex=serial, cert_path=cert_path, key_path=key_path,
                      ca_path=ca_path, not_after=cert.not_valid_after_utc, fingerprint_sha256=fp)


def make_csr(
    *,
    role: str,
    name: str,
    out_dir: str | os.PathLike[str],
    dns: Sequence[str] = (),
    ips: Sequence[Any] = (),
) -> tuple[Path, Path]:
    """Make a new P-256 key and a certificate signing request for ``role``/``name``, on the machine that
    will use them; return ``(key_path, csr_path)`` = ``out_dir/<name>.key`` (mode 0600) and
    ``out_dir/<name>.csr``. Send only the .csr to the CA administrator (``fedclinic pki issue --csr``);
    the key never leaves ``out_dir``."""
    validate_role(role)
    validate_name(name)
    out_dir = _mkdir(Path(out_dir))
    if (out_dir / CA_KEY).exists():
        raise PkiError(f"{out_dir} is a CA folder; make the key and request in the folder of the process that "
                       "will use them, not next to the CA key")
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_subject(role, name))
        .add_extension(x509.SubjectAlternativeName(_san_list(role, name, dns, ips)), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path, csr_path = out_dir / f"{name}.key", out_dir / f"{name}.csr"
    _write_atomic(key_path, _pem_private_key(key), 0o600)
    _write_atomic(csr_path, csr.public_bytes(serialization.Encoding.PEM), 0o644)
    return key_path, csr_path
