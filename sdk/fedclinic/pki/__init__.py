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
services follow those files (:mod:`fedclinic.pki.credentials`).

gRPC Python has no CRL parameter: TLS checks the chain and the validity window, and the aggregator checks
revocation per call with :class:`RevocationList` on the identity that :func:`identity_from_pem` parses
from ``context.auth_context()["x509_pem_cert"][0]``.

Every error is a :class:`PkiError` whose message says what is wrong and what to do about it.

One module per job: :mod:`.common` (constants, records, helpers), :mod:`.authority` (the CA folder), :mod:`.leaf`
(issuing), :mod:`.rotation`, :mod:`.revocation`, :mod:`.identity`, :mod:`.signatures` (detached),
:mod:`.revocation_list`, :mod:`.preflight`, :mod:`.cli`, and :mod:`.credentials` (a service's own files,
followed on disk). This package re-exports the public names of all but the last.
"""

from __future__ import annotations

from fedclinic.pki.common import (
    CA_CERT,
    CA_KEY,
    CLOCK_SKEW,
    CRL_DAYS,
    CRL_FILE,
    IssuedCert,
    LOCK_FILE,
    PeerIdentity,
    PkiError,
    REGISTRY,
    ROLES,
    URI_SCHEME,
    validate_name,
    validate_role,
)
from fedclinic.pki.authority import (
    init_ca,
)
from fedclinic.pki.leaf import (
    issue,
    make_csr,
)
from fedclinic.pki.rotation import (
    install_credentials,
    renew,
)
from fedclinic.pki.revocation import (
    list_certs,
    refresh_crl,
    revoke,
)
from fedclinic.pki.identity import (
    identity_from_pem,
)
from fedclinic.pki.signatures import (
    sign_detached,
    verify_detached,
)
from fedclinic.pki.revocation_list import (
    RevocationList,
)
from fedclinic.pki.preflight import (
    check_own_certificate,
)
from fedclinic.pki.cli import (
    add_pki_commands,
)


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
