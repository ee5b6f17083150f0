"""Detached signatures (backup manifests): sign with a service's TLS key, verify against a certificate the CA issued."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from fedclinic.pki.common import PeerIdentity, PkiError, _PSS, _load_cert, _load_key, _spki, _verify_issued_by
from fedclinic.pki.identity import _identity


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
