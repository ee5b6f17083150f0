"""Peer identity: who a certificate belongs to (:func:`identity_from_pem`), from the fedclinic SAN URI."""

from __future__ import annotations

import functools

from cryptography import x509
from cryptography.x509.oid import NameOID

from fedclinic.pki.common import PeerIdentity, PkiError, ROLES, URI_SCHEME, _fingerprint, _serial_hex


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
