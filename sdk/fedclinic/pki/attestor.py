"""Claims attested with signed statements under the fedclinic CA (what the services plug into secure aggregation).

:class:`CertificateAttestor` implements the attestor interface of :mod:`fedclinic.secagg.attestation` (``attest``,
``check``) over :mod:`fedclinic.pki.signed_statement`: an attestation is a serialized ``fedclinic.v1.SignedStatement``
whose payload is the claim as canonical JSON, signed with the party's certificate key. ``check`` accepts it only
when the fedclinic CA issued the signing certificate, to ``role`` and to exactly the claimed signer's name, for the
given purpose, and the signed payload is the claim presented (not merely a claim about the same keys). Expiry and
revocation are not checked (as for every signed statement): a certificate's key signs one session at a time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from google.protobuf.message import DecodeError

from fedclinic.pki.common import PkiError
from fedclinic.pki.signed_statement import SignedStatement, Signer, canonical_json


class CertificateAttestor:
    """Attest with ``signer`` (this party's certificate key; None = check only) and check against the CA at
    ``ca_path``, requiring certificates of ``role`` (module docstring)."""

    def __init__(self, *, ca_path: str | os.PathLike[str], role: str = "agent", signer: Signer | None = None) -> None:
        self.ca_path, self.role, self.signer = Path(ca_path), role, signer

    def attest(self, purpose: str, claim: Mapping[str, object]) -> bytes:
        """A serialized SignedStatement of ``claim`` for ``purpose`` (PkiError when this party cannot sign)."""
        if self.signer is None:
            raise PkiError("this attestor only checks signatures; it holds no key to sign with")
        return self.signer.sign_json(purpose, dict(claim)).to_proto().SerializeToString()

    def check(self, purpose: str, claim: Mapping[str, object], attestation: bytes, signer: str) -> None:
        """Return only if ``attestation`` is the ``role`` ``signer``'s signed statement of exactly ``claim`` for
        ``purpose`` under the CA; else PkiError saying what failed."""
        from fedclinic.proto import task_pb2  # generated code, as signed_statement.to_proto imports it

        try:
            statement = SignedStatement.from_proto(task_pb2.SignedStatement.FromString(bytes(attestation)))
        except DecodeError:
            raise PkiError(f"the {purpose} signature of {signer!r} is not a signed statement") from None
        statement.verify(ca_path=self.ca_path, role=self.role, name=signer, purpose=purpose)
        if statement.payload != canonical_json(dict(claim)):
            raise PkiError(f"{signer!r} signed a different {purpose} statement than the one presented (the "
                           "relayed content was changed after it was signed)")
