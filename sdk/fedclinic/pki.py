"""fedclinic's small certificate authority, peer identities and revocation (mutual TLS for gRPC).

Every fedclinic process (aggregator, hospital agent, data scientist, administrator) holds an X.509
certificate issued by one fedclinic CA. Its role and name are carried in a SAN URI
``fedclinic://<role>/<name>`` (and, for tools that only show the subject, in OU=<role>, CN=<name>).

A CA folder (``fedclinic pki init-ca --ca-dir DIR``) holds:

- ``ca.key``: the CA's ECDSA P-256 private key (mode 0600; keep this folder offline);
- ``ca.crt``: the self-signed CA certificate (BasicConstraints ca=True, path_length=0);
- ``crl.pem``: the certificate revocation list, signed by the CA and rewritten by every ``revoke``;
- ``issued.json``: the registry of every certificate issued (serial, name, role, validity, fingerprint,
  revocation).

Private keys are always written with mode 0600 from the moment the file exists (``os.open`` with mode
0o600 on a temporary file, then ``os.replace``), never chmod'ed afterwards. Every file is written
atomically, so a crash never leaves a half-written key, certificate, CRL or registry.

Rotation: :func:`renew` (with the CA at hand) or ``request`` + ``issue --csr`` + :func:`install_credentials`
replace a service's key and certificate in place (key first, then certificate, each atomically); running
services follow those files (fedclinic.credentials).

gRPC Python has no CRL parameter: TLS checks the chain and the validity window, and the aggregator checks
revocation per call with :class:`RevocationList` on the identity that :func:`identity_from_pem` parses
from ``context.auth_context()["x509_pem_cert"][0]``.

Every error is a :class:`PkiError` whose message says what is wrong and what to do about it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import functools
import ipaddress
import json
import os
import re
import secrets
import stat
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import FedclinicError

__all__ = [
    "ROLES",
    "PkiError",
    "IssuedCert",
    "PeerIdentity",
    "RevocationList",
    "init_ca",
    "issue",
    "make_csr",
    "renew",
    "install_credentials",
    "revoke",
    "refresh_crl",
    "list_certs",
    "identity_from_pem",
    "check_own_certificate",
    "validate_name",
    "add_pki_commands",
]

log = structlog.get_logger("fedclinic.pki")

ROLES: tuple[str, ...] = ("aggregator", "agent", "scientist", "admin")
"""The only roles a fedclinic certificate can carry."""

URI_SCHEME = "fedclinic://"
#: RSA signatures (detached, e.g. backup manifests): PSS with SHA-256 and the largest salt
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
CA_KEY = "ca.key"
CA_CERT = "ca.crt"
CRL_FILE = "crl.pem"
REGISTRY = "issued.json"
LOCK_FILE = ".lock"
CRL_DAYS = 7
CLOCK_SKEW = dt.timedelta(minutes=5)
"""Certificates are back-dated by this much so a peer whose clock is slightly behind still accepts them."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DNS_RE = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")
_REASONS: dict[str, x509.ReasonFlags] = {
    f.name.replace("_", "-"): f for f in x509.ReasonFlags if f is not x509.ReasonFlags.remove_from_crl
}


class PkiError(FedclinicError):
    """A certificate, key, CSR, CRL or CA folder is missing, invalid, expired, revoked or mismatched."""


@dataclass(frozen=True)
class IssuedCert:
    """What :func:`issue` wrote. ``key_path`` is None when the certificate was signed from a CSR (the key
    stays where the CSR was made)."""

    name: str
    role: str
    serial_hex: str
    cert_path: Path
    key_path: Path | None
    ca_path: Path
    not_after: dt.datetime
    fingerprint_sha256: str


@dataclass(frozen=True)
class PeerIdentity:
    """Who a certificate belongs to: its fedclinic role and name, serial (lowercase hex, no leading
    zeros), SHA-256 fingerprint of the DER certificate (lowercase hex) and expiry (UTC)."""

    name: str
    role: str
    serial_hex: str
    fingerprint_sha256: str
    not_after: dt.datetime


# ----------------------------------------------------------------------------------------------------------
# small helpers


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _utc(value: dt.datetime) -> dt.datetime:
    """A timezone-aware UTC datetime with whole seconds (naive datetimes are taken as UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc).replace(microsecond=0)


def _fmt(value: dt.datetime) -> str:
    return _utc(value).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> dt.datetime:
    return _utc(dt.datetime.fromisoformat(text.replace("Z", "+00:00")))


def _serial_hex(serial: int) -> str:
    return format(serial, "x")


def _norm_serial(serial_hex: str) -> str:
    """Normalise a serial written as hex (any case, optional ``0x``, ``:`` separators, leading zeros)."""
    text = str(serial_hex).strip().lower().replace(":", "")
    if text.startswith("0x"):
        text = text[2:]
    if not text or not re.fullmatch(r"[0-9a-f]+", text):
        raise PkiError(f"{serial_hex!r} is not a certificate serial number; give it in hexadecimal as "
                       "`fedclinic pki list` shows it")
    return _serial_hex(int(text, 16))


def _fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def _issue_hint(role: str, name: str) -> str:
    return f"issue a new one with `fedclinic pki issue --role {role} --name {name}`"


def validate_role(role: str) -> str:
    """Return ``role`` if it is one of :data:`ROLES`, else raise :class:`PkiError`."""
    if role not in ROLES:
        raise PkiError(f"unknown role {role!r}; use one of: {', '.join(ROLES)}")
    return role


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid certificate name, else raise :class:`PkiError`.

    A name is 1-64 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit (it becomes a
    file name and part of the SAN URI). ``ca`` is reserved: ``<out>/ca.crt`` holds the CA certificate.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PkiError(f"invalid certificate name {name!r}: use 1-64 characters of letters, digits, '.', '_' "
                       "and '-', starting with a letter or digit (for example 'site-a' or 'hospital_12')")
    if name.lower() == "ca":
        raise PkiError("the certificate name 'ca' is reserved (<out>/ca.crt holds the CA certificate); "
                       "choose another name, for example 'ca-admin'")
    return name


def _validate_dns(names: Iterable[str]) -> list[str]:
    out = []
    for d in names:
        if not isinstance(d, str) or len(d) > 253 or not _DNS_RE.fullmatch(d):
            raise PkiError(f"invalid DNS name {d!r}; give a host name such as 'aggregator.example.org' "
                           "(ASCII letters, digits, '-' and '.')")
        out.append(d)
    return out


def _validate_ips(values: Iterable[Any]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_address(v))
        except ValueError:
            raise PkiError(f"invalid IP address {v!r}; give an IPv4 or IPv6 address such as 10.0.0.5") from None
    return out


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically (:func:`fedclinic.runtime.durable_file.write_atomically`: the file has
    ``mode`` from the moment it is created); OSError becomes a PkiError that says what to check."""
    path = Path(path)
    if not path.parent.is_dir():
        raise PkiError(f"cannot create {path}: {path.parent} does not exist; create it or choose another folder")
    try:
        write_atomically(path, data, mode=mode)
    except OSError as exc:
        raise PkiError(f"cannot write {path}: {exc.strerror}; check free space and permissions in "
                       f"{path.parent}") from None


def _mkdir(path: Path) -> Path:
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise PkiError(f"cannot create the folder {path}: {exc.strerror}; choose a folder this user can "
                       "write to") from None
    if not path.is_dir():
        raise PkiError(f"{path} exists and is not a folder; choose another path")
    return path


@contextlib.contextmanager
def _ca_lock(ca_dir: Path) -> Iterator[None]:
    """Serialise read-modify-write of the CA folder between processes (advisory ``flock``)."""
    try:
        fd = os.open(Path(ca_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise PkiError(f"cannot lock the CA folder {ca_dir}: {exc.strerror}; run this command as the user "
                       "that owns the CA folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read_bytes(path: Path, label: str, hint: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise PkiError(f"{label} {path} does not exist; {hint}") from None
    except IsADirectoryError:
        raise PkiError(f"{label} {path} is a folder, not a file; give the path of the PEM file") from None
    except OSError as exc:
        raise PkiError(f"cannot read {label} {path}: {exc.strerror}; check its permissions ({hint})") from None


def _load_cert(path: Path, label: str = "certificate", hint: str = "check the path") -> x509.Certificate:
    data = _read_bytes(path, label, hint)
    try:
        if b"-----BEGIN" in data:
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError:
        raise PkiError(f"{label} {path} is not a valid X.509 certificate (PEM or DER); {hint}") from None


def _load_key(path: Path, label: str = "private key") -> Any:
    data = _read_bytes(path, label, "check the path")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise PkiError(f"{label} {path} is encrypted with a password; fedclinic needs an unencrypted key "
                       "file with mode 0600 (decrypt it with `openssl pkey -in KEY -out KEY.plain`)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise PkiError(f"{label} {path} is not a PEM private key; give the .key file written next to the "
                       "certificate by `fedclinic pki issue` or `fedclinic pki request`") from None


def _pem_private_key(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _check_key_type(public_key: Any, what: str) -> None:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if public_key.curve.name not in ("secp256r1", "secp384r1"):
            raise PkiError(f"{what} uses the elliptic curve {public_key.curve.name}, which gRPC peers may not "
                           "accept; make a P-256 key with `fedclinic pki request`")
        return
    if isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < 2048:
            raise PkiError(f"{what} is a {public_key.key_size}-bit RSA key, too weak; make a new key "
                           "(P-256) with `fedclinic pki request`")
        return
    raise PkiError(f"{what} has a {type(public_key).__name__} key, which fedclinic does not issue "
                   "certificates for; make a P-256 key with `fedclinic pki request`")


def _verify_issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """True if ``cert`` names ``ca`` as issuer and its signature verifies with the CA public key
    (ECDSA, RSA PKCS#1 v1.5 / PSS, Ed25519)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# the CA folder


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


def _write_crl(ca: _Ca, registry: dict[str, Any], now: dt.datetime, days: int = CRL_DAYS) -> None:
    """Sign and write ``crl.pem`` listing every revoked serial in ``registry`` (bumps the CRL number)."""
    registry["crl_number"] = int(registry.get("crl_number", 0)) + 1
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


# ----------------------------------------------------------------------------------------------------------
# leaf certificates


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


# ----------------------------------------------------------------------------------------------------------
# rotation: install a new key and certificate over the ones a running service uses


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


# ----------------------------------------------------------------------------------------------------------
# revocation


def _parse_reason(reason: str) -> str:
    key = str(reason).strip().replace("_", "-")
    for canonical, flag in _REASONS.items():
        if key.lower() in (canonical, flag.value.lower()):
            return canonical
    raise PkiError(f"unknown revocation reason {reason!r}; use one of: {', '.join(_REASONS)}")


def revoke(
    ca_dir: str | os.PathLike[str],
    *,
    serial_hex: str | None = None,
    cert_path: str | os.PathLike[str] | None = None,
    reason: str = "unspecified",
) -> str:
    """Revoke a certificate issued by the CA in ``ca_dir``, given by ``serial_hex`` or by its file
    ``cert_path`` (exactly one); return its serial (lowercase hex).

    Marks it revoked in ``issued.json`` and rewrites ``crl.pem`` (signed by the CA, listing every revoked
    serial, next update in 7 days). Revoking an already revoked certificate keeps its first revocation time
    and reason and is not an error. A serial that this CA never issued is a :class:`PkiError`; a certificate
    file signed by this CA but missing from the registry is added to it and revoked. ``reason`` is a RFC 5280
    reason such as ``key-compromise``, ``superseded`` or ``cessation-of-operation``.
    """
    if (serial_hex is None) == (cert_path is None):
        raise PkiError("give exactly one of --serial and --cert to say which certificate to revoke")
    reason_name = _parse_reason(reason)
    ca_dir = Path(ca_dir)
    ca = _load_ca(ca_dir)
    cert: x509.Certificate | None = None
    if cert_path is not None:
        cert = _load_cert(Path(cert_path))
        if not _verify_issued_by(cert, ca.cert):
            raise PkiError(f"{cert_path} was not issued by the CA in {ca_dir}; revoke it with the CA that "
                           "issued it")
        serial = _serial_hex(cert.serial_number)
    else:
        serial = _norm_serial(str(serial_hex))
    with _ca_lock(ca_dir):
        registry = _load_registry(ca_dir)
        rec = next((r for r in registry["certificates"] if _norm_serial(r["serial"]) == serial), None)
        if rec is None and cert is not None:
            ident = _identity(cert)
            rec = {"serial": serial, "name": ident.name, "role": ident.role,
                   "not_before": _fmt(cert.not_valid_before_utc), "not_after": _fmt(cert.not_valid_after_utc),
                   "fingerprint_sha256": ident.fingerprint_sha256, "revoked_at": None, "reason": None}
            registry["certificates"].append(rec)
        if rec is None:
            raise PkiError(f"no certificate with serial {serial} was issued by the CA in {ca_dir}; check the serial "
                           f"with `fedclinic pki list --ca-dir {ca_dir}`")
        if not rec.get("revoked_at"):
            rec["revoked_at"] = _fmt(_now())
            rec["reason"] = reason_name
        _write_crl(ca, registry, _now())
        _save_registry(ca_dir, registry)
    return serial


def refresh_crl(ca_dir: str | os.PathLike[str], *, days: int = CRL_DAYS) -> Path:
    """Re-sign ``crl.pem`` with the same revoked serials and a new next-update time (now + ``days``);
    run it before the CRL's next update passes if nothing was revoked in the meantime."""
    ca = _load_ca(Path(ca_dir))
    with _ca_lock(ca.dir):
        registry = _load_registry(ca.dir)
        _write_crl(ca, registry, _now(), days)
        _save_registry(ca.dir, registry)
    return ca.dir / CRL_FILE


def _status(rec: dict[str, Any], now: dt.datetime) -> str:
    if rec.get("revoked_at"):
        return "revoked"
    if _parse_time(rec["not_before"]) > now:
        return "not-yet-valid"
    if _parse_time(rec["not_after"]) <= now:
        return "expired"
    return "valid"


def list_certs(ca_dir: str | os.PathLike[str], *, now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Every certificate the CA in ``ca_dir`` issued, oldest first, as dicts with the registry fields
    (serial, name, role, not_before, not_after, fingerprint_sha256, revoked_at, reason) plus ``status``:
    ``"revoked"`` (wins over the others), ``"not-yet-valid"``, ``"expired"`` or ``"valid"`` at ``now``
    (default: the current time)."""
    ca_dir = Path(ca_dir)
    if not (ca_dir / CA_CERT).exists():
        raise PkiError(f"{ca_dir} is not a fedclinic CA folder (no {CA_CERT}); {_no_ca_hint(ca_dir)}")
    at = _utc(now) if now is not None else _now()
    return [{**rec, "status": _status(rec, at)} for rec in _load_registry(ca_dir)["certificates"]]


# ----------------------------------------------------------------------------------------------------------
# peer identity


def _identity(cert: x509.Certificate) -> PeerIdentity:
    role = name = None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(URI_SCHEME)]
    except x509.ExtensionNotFound:
        uris = []
    if len(set(uris)) > 1:
        raise PkiError(f"certificate {_serial_hex(cert.serial_number)} carries several fedclinic identities "
                       f"({', '.join(uris)}); it was not made by fedclinic, issue a new one with `fedclinic pki issue`")
    if uris:
        parts = uris[0][len(URI_SCHEME):].split("/")
        if len(parts) != 2:
            raise PkiError(f"certificate {_serial_hex(cert.serial_number)} has a malformed identity {uris[0]!r} "
                           "(expected fedclinic://<role>/<name>); issue a new one with `fedclinic pki issue`")
        role, name = parts
    else:
        ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if ous and cns:
            role, name = str(ous[0].value), str(cns[0].value)
    if role not in ROLES or not name:
        raise PkiError(f"certificate {_serial_hex(cert.serial_number)} (subject {cert.subject.rfc4514_string()}) "
                       f"carries no fedclinic role (SAN URI fedclinic://<role>/<name> or OU=<role> with one of "
                       f"{', '.join(ROLES)}); issue a fedclinic certificate with `fedclinic pki issue`")
    return PeerIdentity(name=name, role=role, serial_hex=_serial_hex(cert.serial_number),
                        fingerprint_sha256=_fingerprint(cert), not_after=cert.not_valid_after_utc)


@functools.lru_cache(maxsize=4096)
def identity_from_pem(pem: bytes) -> PeerIdentity:
    """Parse a peer certificate (PEM bytes, as ``context.auth_context()["x509_pem_cert"][0]`` gives it)
    into its :class:`PeerIdentity`: role and name from the SAN URI ``fedclinic://<role>/<name>``, falling
    back to OU=<role> and CN=<name>.

    This does NOT verify the certificate: call it only on certificates the TLS handshake has already
    checked against the CA (and check revocation separately with :class:`RevocationList`). Results are
    cached per PEM (it runs on every RPC); failures raise :class:`PkiError` and are not cached.
    """
    if isinstance(pem, str):
        pem = pem.encode("ascii")
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise PkiError("the peer certificate is not a valid PEM X.509 certificate; the peer must connect with "
                       "a certificate from `fedclinic pki issue`") from None
    return _identity(cert)


# ----------------------------------------------------------------------------------------------------------
# detached signatures (backup manifests)


def sign_detached(data: bytes, *, key_path: str | os.PathLike[str], cert_path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """Sign ``data`` with the private key at ``key_path``: ECDSA with SHA-256 (P-256/P-384 keys) or RSA-PSS with
    SHA-256. Returns ``(signature, certificate PEM)``; PkiError when the key does not belong to the certificate."""
    key = _load_key(Path(key_path))
    cert = _load_cert(Path(cert_path), "certificate", "give the certificate that belongs to the key")
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise PkiError(f"the key {key_path} does not belong to the certificate {cert_path}; give the pair "
                       "`fedclinic pki issue` wrote together")
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(data, _PSS, hashes.SHA256())
    else:
        raise PkiError(f"the key {key_path} is a {type(key).__name__}; fedclinic signs with EC or RSA keys only")
    return signature, cert.public_bytes(serialization.Encoding.PEM)


def verify_detached(data: bytes, signature: bytes, cert_pem: bytes, *, ca_path: str | os.PathLike[str],
                    role: str) -> PeerIdentity:
    """Check that ``signature`` over ``data`` was made with the key of ``cert_pem``, a certificate that the CA at
    ``ca_path`` issued, for a fedclinic identity of ``role``. Returns that identity; PkiError naming what failed.
    Expiry is not checked (a signature made while the certificate was valid stays valid), nor revocation."""
    ca = _load_cert(Path(ca_path), "CA certificate", "give the fedclinic CA certificate (ca.crt)")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise PkiError("the signer's certificate is not a valid PEM X.509 certificate") from None
    if not _verify_issued_by(cert, ca):
        raise PkiError(f"the signer's certificate (subject {cert.subject.rfc4514_string()}) was not issued by the CA "
                       f"{ca_path}")
    identity = _identity(cert)
    if identity.role != role:
        raise PkiError(f"the signer is the {identity.role} {identity.name!r}; this signature must come from a "
                       f"certificate of role {role!r}")
    public = cert.public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, data, _PSS, hashes.SHA256())
        else:
            raise PkiError(f"the signer's certificate has a {type(public).__name__} key, which fedclinic does not use")
    except InvalidSignature:
        raise PkiError(f"the signature does not match the data: it was changed after the {role} "
                       f"{identity.name!r} signed it") from None
    return identity


# ----------------------------------------------------------------------------------------------------------
# revocation list


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


# ----------------------------------------------------------------------------------------------------------
# preflight of a process's own credentials


def check_own_certificate(
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    ca_path: str | os.PathLike[str],
    *,
    expected_role: str | None = None,
    now: dt.datetime | None = None,
    check_key_mode: bool = True,
) -> PeerIdentity:
    """Check a process's own TLS credentials before it connects; return its identity.

    Raises :class:`PkiError` (saying what to do) unless: the three files exist and are readable; the key
    file is not readable or writable by group or others (skipped with ``check_key_mode=False``, for
    credentials reloaded at run time, e.g. from a Kubernetes Secret mounted 0440); the key is the
    certificate's key; the certificate
    is signed by the CA in ``ca_path`` (ECDSA or RSA); ``now`` (default: the current time) is within the
    certificate's validity window; it carries a fedclinic identity; and its role is ``expected_role`` when
    given.
    """
    cert_path, key_path, ca_path = Path(cert_path), Path(key_path), Path(ca_path)
    hint = "create credentials with `fedclinic pki issue` and set the path in the configuration"
    cert = _load_cert(cert_path, "certificate", hint)
    ca = _load_cert(ca_path, "CA certificate", "copy ca.crt from the folder `fedclinic pki issue` wrote")
    try:
        mode = stat.S_IMODE(os.stat(key_path).st_mode)
    except FileNotFoundError:
        raise PkiError(f"private key {key_path} does not exist; {hint}") from None
    except OSError as exc:
        raise PkiError(f"cannot read private key {key_path}: {exc.strerror}; check its permissions") from None
    if check_key_mode and mode & 0o077:
        raise PkiError(f"private key {key_path} has mode {mode:04o}, so other users can read it; run "
                       f"`chmod 600 {key_path}` (and consider the key exposed if others had access)")
    key = _load_key(key_path)
    ident = _identity(cert)
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise PkiError(f"private key {key_path} does not belong to certificate {cert_path}; use the .key file "
                       f"issued together with it, or {_issue_hint(ident.role, ident.name)}")
    if not _verify_issued_by(cert, ca):
        raise PkiError(f"certificate {cert_path} was not issued by the CA in {ca_path} (its issuer is "
                       f"{cert.issuer.rfc4514_string()}, the CA is {ca.subject.rfc4514_string()}); use the ca.crt "
                       f"of the CA that issued it, or {_issue_hint(ident.role, ident.name)} from this CA")
    at = _utc(now) if now is not None else _now()
    nb, na = cert.not_valid_before_utc, cert.not_valid_after_utc
    if at < nb:
        raise PkiError(f"certificate {cert_path} is not valid yet: valid from {_fmt(nb)} to {_fmt(na)}, and it "
                       f"is now {_fmt(at)}; check this machine's clock, or wait until {_fmt(nb)}")
    if at >= na:
        raise PkiError(f"certificate {cert_path} expired on {_fmt(na)} (valid from {_fmt(nb)}); "
                       f"{_issue_hint(ident.role, ident.name)}")
    if expected_role is not None and ident.role != expected_role:
        raise PkiError(f"certificate {cert_path} is for role {ident.role!r} ({ident.name}), but this process "
                       f"needs role {expected_role!r}; {_issue_hint(expected_role, ident.name)}")
    return ident


# ----------------------------------------------------------------------------------------------------------
# command line


def _cmd_init_ca(args: argparse.Namespace) -> int:
    ca_crt = init_ca(args.ca_dir, common_name=args.name, days=args.days)
    cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    print(f"created CA {args.name!r} in {args.ca_dir} (valid until {_fmt(cert.not_valid_after_utc)})")
    print(f"  {Path(args.ca_dir) / CA_KEY}  (private, mode 0600: keep this folder offline and backed up)")
    print(f"  {ca_crt}  (give this to every participant)")
    print(f"  {Path(args.ca_dir) / CRL_FILE}  (revocation list for the aggregator)")
    return 0


def _cmd_issue(args: argparse.Namespace) -> int:
    res = issue(args.ca_dir, role=args.role, name=args.name, out_dir=args.out, days=args.days,
                dns=args.dns or (), ips=args.ip or (), csr_path=args.csr)
    print(f"issued {res.role} certificate {res.name!r}, serial {res.serial_hex}, valid until {_fmt(res.not_after)}")
    print(f"  certificate: {res.cert_path}")
    if res.key_path is not None:
        print(f"  private key: {res.key_path}  (mode 0600; move it only over a secure channel)")
    print(f"  CA:          {res.ca_path}")
    return 0


def _cmd_request(args: argparse.Namespace) -> int:
    key_path, csr_path = make_csr(role=args.role, name=args.name, out_dir=args.out, dns=args.dns or (),
                                  ips=args.ip or ())
    print(f"made a private key and a certificate request for {args.role} {args.name!r}")
    print(f"  private key: {key_path}  (mode 0600; it stays here)")
    print(f"  request:     {csr_path}")
    print(f"send {csr_path.name} to the fedclinic administrator, who runs: fedclinic pki issue --ca-dir CA_DIR "
          f"--role {args.role} --name {args.name} --csr {csr_path.name} --out DIR")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    serial = revoke(args.ca_dir, serial_hex=args.serial, cert_path=args.cert, reason=args.reason)
    print(f"revoked certificate {serial}; the revocation list {Path(args.ca_dir) / CRL_FILE} was rewritten: "
          "copy it to the aggregator (it reloads the file when it changes)")
    return 0


def _cmd_renew(args: argparse.Namespace) -> int:
    old = _identity(_load_cert(args.cert, "certificate", "give the certificate file the service uses")).serial_hex
    res = renew(args.ca_dir, cert_path=args.cert, key_path=args.key, days=args.days, revoke_old=args.revoke_old)
    print(f"renewed {res.role} certificate {res.name!r}: new serial {res.serial_hex}, valid until "
          f"{_fmt(res.not_after)}")
    print(f"  certificate: {res.cert_path}")
    print(f"  private key: {res.key_path}  (new key, made here, mode 0600)")
    print("a running aggregator or agent picks the new pair up by itself (or on SIGHUP); open connections keep "
          "the old certificate until they reconnect" + ("" if args.revoke_old else
          f". Revoke the old one once the service logged the reload: fedclinic pki revoke --ca-dir {args.ca_dir} "
          f"--serial {old} --reason superseded"))
    return 0


def _cmd_install(args: argparse.Namespace) -> int:
    ident = install_credentials(args.cert, args.key, args.ca, to_cert=args.to_cert, to_key=args.to_key,
                                expected_role=args.role)
    print(f"installed {ident.role} certificate {ident.name!r} (serial {ident.serial_hex}, valid until "
          f"{_fmt(ident.not_after)}) as {args.to_cert} with its key {args.to_key}")
    return 0


def _cmd_refresh_crl(args: argparse.Namespace) -> int:
    path = refresh_crl(args.ca_dir, days=args.days)
    print(f"re-signed {path} with the same revoked serials, next update in {args.days} days: copy it to the "
          "aggregator if it does not read it from the CA folder")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = list_certs(args.ca_dir)
    if not rows:
        print(f"no certificates issued yet by the CA in {args.ca_dir}")
        return 0
    header = ("NAME", "ROLE", "STATUS", "NOT AFTER", "SERIAL", "SHA256")
    table = [header] + [(r["name"], r["role"], r["status"], r["not_after"], r["serial"],
                         r["fingerprint_sha256"][:16]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _guard(handler: Any) -> Any:
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except FedclinicError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return run


def add_pki_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``pki`` and its subcommands (init-ca, issue, request, renew, install, revoke, refresh-crl, list) on
    an argparse ``add_subparsers()`` object. Each subcommand sets ``func`` to a handler ``(args) -> int`` that prints a
    short summary and returns 0, or prints ``error: <message>`` to stderr and returns 2."""
    pki = subparsers.add_parser("pki", help="certificates: create a CA, issue, request, renew, install, revoke, list",
                                description="Manage the fedclinic certificate authority and certificates.")
    sub = pki.add_subparsers(dest="pki_command", metavar="COMMAND", required=True)

    p = sub.add_parser("init-ca", help="create a new CA folder (ca.key, ca.crt, crl.pem, issued.json)")
    p.add_argument("--ca-dir", required=True, type=Path, help="folder to create the CA in (keep it offline)")
    p.add_argument("--name", default="fedclinic CA", help="CA common name (default: %(default)s)")
    p.add_argument("--days", type=int, default=3650, help="validity in days (default: %(default)s)")
    p.set_defaults(func=_guard(_cmd_init_ca))

    def sans(q: argparse.ArgumentParser) -> None:
        q.add_argument("--dns", action="extend", nargs="+", default=[], metavar="NAME",
                       help="DNS name(s) to put in the certificate (the aggregator's host names)")
        q.add_argument("--ip", action="extend", nargs="+", default=[], metavar="IP",
                       help="IP address(es) to put in the certificate")

    p = sub.add_parser("issue", help="issue a certificate (new key, or from a --csr)")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--name", required=True, help="site or user name, e.g. site-a")
    p.add_argument("--out", required=True, type=Path, help="folder to write <name>.crt, <name>.key, ca.crt to")
    p.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    sans(p)
    p.add_argument("--csr", type=Path, default=None, help="sign this request instead of making a key")
    p.set_defaults(func=_guard(_cmd_issue))

    p = sub.add_parser("request", help="make a private key and a certificate request (CSR) here")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True, type=Path, help="folder to write <name>.key and <name>.csr to")
    sans(p)
    p.set_defaults(func=_guard(_cmd_request))

    p = sub.add_parser("revoke", help="revoke a certificate and rewrite the CA's crl.pem")
    p.add_argument("--ca-dir", required=True, type=Path)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--serial", help="serial number in hex, as `pki list` shows it")
    which.add_argument("--cert", type=Path, help="the certificate file")
    p.add_argument("--reason", default="unspecified", help=f"one of: {', '.join(_REASONS)}")
    p.set_defaults(func=_guard(_cmd_revoke))

    p = sub.add_parser("renew", help="renew a certificate in place: new key here, same identity, new certificate")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--cert", required=True, type=Path, help="the certificate file the service uses")
    p.add_argument("--key", type=Path, default=None, help="its key file (default: the certificate path with .key)")
    p.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    p.add_argument("--revoke-old", action="store_true", help="revoke the old certificate (reason superseded)")
    p.set_defaults(func=_guard(_cmd_renew))

    p = sub.add_parser("install", help="check a new certificate and key, then put them in place of the live ones")
    p.add_argument("--cert", required=True, type=Path, help="the new certificate (from `pki issue --csr`)")
    p.add_argument("--key", required=True, type=Path, help="its key (from `pki request`, made on this machine)")
    p.add_argument("--ca", required=True, type=Path, help="the CA certificate")
    p.add_argument("--to-cert", required=True, type=Path, help="the certificate file the service uses")
    p.add_argument("--to-key", required=True, type=Path, help="the key file the service uses")
    p.add_argument("--role", choices=ROLES, default=None, help="refuse a certificate for another role")
    p.set_defaults(func=_guard(_cmd_install))

    p = sub.add_parser("refresh-crl", help="re-sign crl.pem with a new next-update time (run weekly)")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--days", type=int, default=CRL_DAYS, help="next update in this many days (default: %(default)s)")
    p.set_defaults(func=_guard(_cmd_refresh_crl))

    p = sub.add_parser("list", help="list issued certificates and their status")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.set_defaults(func=_guard(_cmd_list))
