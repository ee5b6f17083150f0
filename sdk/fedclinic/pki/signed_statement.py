"""Signed statements: a payload signed with a certificate key, for a stated purpose, checked against the CA.

What a party asserts to others through an untrusted relay (the aggregator) travels as a :class:`SignedStatement`
(proto ``fedclinic.v1.SignedStatement``): the exact payload bytes, the signature and the signer's certificate. The
signature covers ``encode(DOMAIN, purpose, payload)`` (length-prefixed, so no two (purpose, payload) pairs sign the
same bytes): a statement signed for one purpose ("task", "secagg-keys", "round-statement", ...) is never accepted
for another. Payloads are canonical JSON (:func:`canonical_json`), so a verifier reads what was signed, not a
re-serialization of it.

Signing: ECDSA P-256 / SHA-256 or RSA-PSS (:mod:`fedclinic.pki.signatures`). Verification checks that the CA issued
the certificate, the identity's role (and name when given), and the signature; expiry and revocation are not
checked (a statement made while the certificate was valid stays valid), which callers that need them add.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedclinic.pki.common import PeerIdentity, PkiError
from fedclinic.pki.signatures import sign_detached, verify_detached

DOMAIN = b"fedclinic-signed-statement-v1"


def canonical_json(obj: Any) -> bytes:
    """``obj`` as canonical JSON bytes: sorted keys, no whitespace, UTF-8, no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def signed_bytes(purpose: str, payload: bytes) -> bytes:
    """The bytes a signature covers: the domain, the purpose and the payload, each length-prefixed."""
    parts = [DOMAIN, purpose.encode(), payload]
    return b"".join(struct.pack(">Q", len(p)) + p for p in parts)


@dataclass(frozen=True)
class SignedStatement:
    """``payload`` signed for ``purpose`` by the holder of ``certificate_pem``'s key."""

    purpose: str
    payload: bytes
    signature: bytes
    certificate_pem: bytes

    def json(self) -> Any:
        """The payload parsed as JSON (PkiError when it is not)."""
        try:
            return json.loads(self.payload)
        except (ValueError, UnicodeDecodeError):
            raise PkiError(f"the signed {self.purpose} statement is not JSON") from None

    def to_proto(self):
        from fedclinic.proto import task_pb2

        return task_pb2.SignedStatement(purpose=self.purpose, payload=self.payload, signature=self.signature,
                                        certificate_pem=self.certificate_pem)

    @classmethod
    def from_proto(cls, msg) -> "SignedStatement":
        return cls(msg.purpose, bytes(msg.payload), bytes(msg.signature), bytes(msg.certificate_pem))

    def verify(self, *, ca_path: str | os.PathLike[str], role: str, name: str | None = None,
               purpose: str | None = None) -> PeerIdentity:
        """Check the statement (module docstring): issued by the CA at ``ca_path``, to ``role`` (and ``name``),
        for ``purpose`` (default: the one it names). Returns the signer; PkiError saying what failed."""
        if purpose is not None and self.purpose != purpose:
            raise PkiError(f"a statement signed for {self.purpose!r} was given where one for {purpose!r} is needed")
        if not self.signature or not self.certificate_pem:
            raise PkiError(f"the {self.purpose} statement is not signed")
        identity = verify_detached(signed_bytes(self.purpose, self.payload), self.signature, self.certificate_pem,
                                   ca_path=ca_path, role=role)
        if name is not None and identity.name != name:
            raise PkiError(f"the {self.purpose} statement is signed by the {identity.role} {identity.name!r}, not by "
                           f"{name!r}")
        return identity


class Signer:
    """Signs statements with a service's own key and certificate (read from disk at each call, so a rotated
    pair is used as soon as it is in place)."""

    def __init__(self, *, key_path: str | os.PathLike[str], cert_path: str | os.PathLike[str]) -> None:
        self.key_path, self.cert_path = Path(key_path), Path(cert_path)

    def sign(self, purpose: str, payload: bytes) -> SignedStatement:
        signature, cert_pem = sign_detached(signed_bytes(purpose, payload), key_path=self.key_path,
                                            cert_path=self.cert_path)
        return SignedStatement(purpose, payload, signature, cert_pem)

    def sign_json(self, purpose: str, obj: Any) -> SignedStatement:
        return self.sign(purpose, canonical_json(obj))
