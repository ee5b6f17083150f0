"""Preflight of a process's own credentials before it connects (:func:`check_own_certificate`)."""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path

from fedclinic.pki.common import (
    PeerIdentity,
    PkiError,
    _fmt,
    _issue_hint,
    _load_cert,
    _load_key,
    _now,
    _spki,
    _utc,
    _verify_issued_by,
)
from fedclinic.pki.identity import _identity


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
