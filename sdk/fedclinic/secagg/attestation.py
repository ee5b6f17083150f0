"""What a site vouches for through the aggregator, and how its peers check it (the malicious-server variant).

The aggregator relays every message between sites, so an active aggregator could substitute the public keys of
one site in the key directory it sends another (and decrypt the shares addressed to it), answer with sybil sites,
or tell each site a different survivor set. Bonawitz et al. (CCS 2017, the malicious-server protocol) close that
with signatures under a PKI: each site signs (session id, its keys), every site checks every peer's signature,
and in a *consistency round* every survivor signs the survivor set U3; a site releases no unmasking share before
it holds at least a quorum of valid signatures over exactly the set it is asked to unmask with.

This module keeps the library PKI-agnostic: it fixes *what* is attested (the claims, as JSON-ready dicts; the
purposes) and the interface of whoever attests (:class:`Attestor`). The services plug in
:class:`fedclinic.pki.attestor.CertificateAttestor` (signed statements under the fedclinic CA, role ``agent``, the
certificate's name = the site id). :class:`InProcessNotary` is for :func:`fedclinic.secagg.run_round` only: every
client runs in one process and it checks claims against what each client really attested there; it proves
nothing across processes and is never used by the services.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

from fedclinic.errors import FedclinicError
from fedclinic.secagg.errors import SecAggIntegrityError
from fedclinic.secagg.messages import AdvertiseKeys

KEYS_PURPOSE = "secagg-keys"
"""Purpose of a site's attestation of its two public keys for one session."""
SURVIVORS_PURPOSE = "secagg-survivors"
"""Purpose of a survivor's attestation of the survivor set U3 of one session (the consistency round)."""

Claim = Mapping[str, object]


def keys_claim(advert: AdvertiseKeys) -> dict[str, object]:
    """What a site attests in phase 1: session id, its site id and both X25519 public keys (hex)."""
    return {"session_id": advert.session_id.hex(), "site_id": advert.sender,
            "mask_public_key": advert.mask_public_key.hex(),
            "encryption_public_key": advert.encryption_public_key.hex()}


def survivors_claim(session_id: bytes, survivors: Iterable[str]) -> dict[str, object]:
    """What a survivor attests in the consistency round: the session id and the sorted survivor set."""
    return {"session_id": session_id.hex(), "survivors": sorted(survivors)}


class Attestor(Protocol):
    """One site's means to vouch for a claim and to check a peer's attestation (module docstring)."""

    def attest(self, purpose: str, claim: Claim) -> bytes:
        """This site's attestation that it makes ``claim`` for ``purpose`` (opaque bytes the aggregator relays)."""

    def check(self, purpose: str, claim: Claim, attestation: bytes, signer: str) -> None:
        """Return only if ``attestation`` is ``signer``'s attestation of exactly ``claim`` for ``purpose``;
        otherwise raise a :class:`~fedclinic.errors.FedclinicError` whose message says what failed."""


def check_attestation(attestor: Attestor, purpose: str, claim: Claim, attestation: bytes, signer: str) -> str | None:
    """``attestor.check`` as a verdict: None when the attestation holds, else the reason it does not (whatever the
    relayed bytes make the check raise is a reason to refuse, never an exception that escapes)."""
    if not attestation:
        return f"{signer!r} sent no signature"
    try:
        attestor.check(purpose, claim, attestation, signer)
    except (FedclinicError, ValueError, TypeError) as exc:  # e.g. a certificate the X.509 parser chokes on
        return str(exc) or type(exc).__name__
    return None


class InProcessNotary:
    """An in-memory notary for clients that all run in this process (:func:`~fedclinic.secagg.run_round`).

    ``for_site(name)`` is that site's :class:`Attestor`: ``attest`` records (site, purpose, claim) under a fresh
    random token; ``check`` accepts a token only for the (site, purpose, claim) it was issued for. It detects a
    tampered directory or survivor set between clients of one process, with no cryptography; it is NOT a
    signature and never crosses a process boundary."""

    def __init__(self) -> None:
        self._issued: dict[bytes, tuple[str, str, tuple[tuple[str, str], ...]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(claim: Claim) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, repr(v)) for k, v in claim.items()))

    def for_site(self, site: str) -> "Attestor":
        return _NotarySite(self, site)

    def _attest(self, site: str, purpose: str, claim: Claim) -> bytes:
        token = os.urandom(16)
        with self._lock:
            self._issued[token] = (site, purpose, self._key(claim))
        return token

    def _check(self, purpose: str, claim: Claim, attestation: bytes, signer: str) -> None:
        with self._lock:
            record = self._issued.get(bytes(attestation))
        if record is None:
            raise SecAggIntegrityError(f"the {purpose} attestation of {signer!r} was never issued by this notary")
        site, issued_for, key = record
        if site != signer:
            raise SecAggIntegrityError(f"the {purpose} attestation was made by {site!r}, not by {signer!r}")
        if issued_for != purpose or key != self._key(claim):
            raise SecAggIntegrityError(f"{signer!r} attested another {issued_for} claim than the one presented")


class _NotarySite:
    def __init__(self, notary: InProcessNotary, site: str) -> None:
        self._notary, self._site = notary, site

    def attest(self, purpose: str, claim: Claim) -> bytes:
        return self._notary._attest(self._site, purpose, claim)

    def check(self, purpose: str, claim: Claim, attestation: bytes, signer: str) -> None:
        self._notary._check(purpose, claim, attestation, signer)
