"""Who may query a ``fedclinic serve`` model: certificate roles and an optional bearer token.

- **Certificates** (HTTPS with ``--https`` and the gRPC port, both with ``--cert/--key/--ca``): the TLS
  handshake has checked that the client certificate chains to the fedclinic CA; :meth:`CallerPolicy.check_certificate`
  then reads its fedclinic role (:func:`fedclinic.pki.identity_from_pem`) and admits only the roles allowed to
  query a model, by default ``scientist`` (the people who train and evaluate models) and ``agent`` (a site's
  own identity, which its integration engine uses to call the site's model). ``aggregator`` (a server's
  identity) and ``admin`` (operations) are refused unless ``--allow-roles`` names them.
- **Revocation** (``--crl``, the ``crl.pem`` of ``fedclinic pki``): a revoked certificate is refused, the list
  is re-read when the file changes (:class:`fedclinic.pki.RevocationList`, which also refuses a CRL older than
  the one in use).
- **Bearer token** (``--token-file``): every request except ``/healthz`` (and every gRPC call except health)
  must carry ``Authorization: Bearer <token>``; the token is compared in constant time.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fedclinic.errors import ConfigError
from fedclinic.pki import PkiError, ROLES, RevocationList, identity_from_pem

DEFAULT_ROLES: tuple[str, ...] = ("scientist", "agent")
#: the shortest token accepted from --token-file (characters)
MIN_TOKEN_CHARS = 16


class CallerPolicy:
    """The roles allowed to query the model and the bearer token (None: no token required)."""

    def __init__(self, roles: tuple[str, ...] = DEFAULT_ROLES, token: str | None = None,
                 revocations: RevocationList | None = None) -> None:
        unknown = [r for r in roles if r not in ROLES]
        if unknown or not roles:
            raise ConfigError(f"--allow-roles: unknown role(s) {unknown or roles}; use some of {', '.join(ROLES)}")
        self.roles = tuple(roles)
        self._token = token.encode() if token is not None else None
        self.revocations = revocations

    @classmethod
    def from_token_file(cls, path: str | None, roles: tuple[str, ...] = DEFAULT_ROLES,
                        revocations: RevocationList | None = None) -> CallerPolicy:
        """The policy with the token read from ``path`` (one line; surrounding whitespace ignored)."""
        if path is None:
            return cls(roles, revocations=revocations)
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ConfigError(f"the token in {path} must be one word of at least {MIN_TOKEN_CHARS} characters; make "
                              "one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        return cls(roles, token, revocations)

    @property
    def needs_token(self) -> bool:
        return self._token is not None

    def check_token(self, authorization: str | None) -> str | None:
        """None when the ``Authorization`` header value carries the token (or none is required), else why not."""
        if self._token is None:
            return None
        scheme, _, value = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            return "this server requires 'Authorization: Bearer <token>' (ask its operator for the token)"
        if not hmac.compare_digest(value.strip().encode(), self._token):
            return "the bearer token is not this server's token"
        return None

    def check_certificate(self, pem: bytes | str | None) -> str | None:
        """None when the verified client certificate ``pem`` has an allowed role, else why not (None for ``pem``
        when the connection carries no certificate: refused)."""
        if not pem:
            return "this server requires a client certificate from the fedclinic CA (mutual TLS)"
        try:
            ident = identity_from_pem(pem.encode("ascii") if isinstance(pem, str) else pem)
        except PkiError as exc:
            return str(exc)
        if self.revocations is not None:
            self.revocations.reload_if_changed()
            if self.revocations.is_revoked(ident.serial_hex):
                return (f"certificate {ident.serial_hex} of {ident.role} {ident.name!r} has been revoked; ask the "
                        "fedclinic administrator for a new certificate")
        if ident.role not in self.roles:
            return (f"a certificate with role {ident.role!r} ({ident.name!r}) may not query this model; it needs role "
                    f"{' or '.join(self.roles)} (fedclinic serve --allow-roles)")
        return None
