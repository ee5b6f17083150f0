"""Constants, :class:`PkiError`, the certificate and identity records, and the small helpers every part of the PKI uses (names, SANs, key and file I/O, the CA folder lock)."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import FedclinicError


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
