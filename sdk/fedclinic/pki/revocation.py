"""Revocation: revoke an issued certificate and re-sign the CRL (:func:`revoke`, :func:`refresh_crl`, :func:`list_certs`)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

from cryptography import x509

from fedclinic.pki.common import (
    CA_CERT,
    CRL_DAYS,
    CRL_FILE,
    PkiError,
    _REASONS,
    _ca_lock,
    _fmt,
    _load_cert,
    _norm_serial,
    _now,
    _parse_time,
    _serial_hex,
    _utc,
    _verify_issued_by,
)
from fedclinic.pki.authority import _load_ca, _load_registry, _no_ca_hint, _save_registry, _write_crl
from fedclinic.pki.identity import _identity


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
