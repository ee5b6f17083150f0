"""Authenticated encryption of the Shamir shares one client sends another through the server.

Ciphertext layout: ``nonce (12 bytes) || AES-256-GCM(key, nonce, plaintext, ad)`` where

- ``key = agree(c_u^SK, c_v^PK, purpose="share-encryption")`` (see :mod:`fedclinic.secagg.keys`);
- ``nonce`` is 96 random bits. The pair key is symmetric, so it encrypts at most two messages
  (u -> v and v -> u); random nonces make a repeat a 2^-96 event;
- ``ad = encode(DOMAIN, "share-keys", session_id, sender, receiver)`` binds the session (hence task,
  round, cohort, model hash), the phase and the direction. A ciphertext replayed into another session,
  re-addressed to another receiver, attributed to another sender or moved to another phase fails to
  decrypt (GCM tag check), as does any flipped bit;
- ``plaintext = encode(DOMAIN, "share", sender, receiver, x, self_mask_share, mask_key_share)``; the
  decrypting client also checks that the ids and its abscissa ``x`` inside match what it expects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedclinic.secagg.encoding import DOMAIN, encode
from fedclinic.secagg.errors import SecAggIntegrityError
from fedclinic.secagg.shamir import SHARE_BYTES, decode_share, encode_share

NONCE_BYTES = 12
PHASE = "share-keys"


@dataclass(frozen=True)
class SharePayload:
    """What one share ciphertext carries: the holder's points of the sender's two polynomials."""

    sender: str
    receiver: str
    x: int
    self_mask_share: int
    mask_key_share: int

    def to_bytes(self) -> bytes:
        return encode(DOMAIN, "share", self.sender, self.receiver, self.x,
                      encode_share(self.self_mask_share), encode_share(self.mask_key_share))

    @classmethod
    def from_bytes(cls, data: bytes) -> SharePayload:
        parts = _decode(data)
        if (len(parts) != 7 or parts[0] != (b"s", DOMAIN.encode()) or parts[1] != (b"s", b"share")
                or [t for t, _ in parts] != [b"s", b"s", b"s", b"s", b"i", b"b", b"b"]
                or len(parts[5][1]) != SHARE_BYTES or len(parts[6][1]) != SHARE_BYTES):
            raise SecAggIntegrityError("share plaintext has the wrong layout")
        return cls(sender=parts[2][1].decode(), receiver=parts[3][1].decode(),
                   x=int.from_bytes(parts[4][1], "big"), self_mask_share=decode_share(parts[5][1]),
                   mask_key_share=decode_share(parts[6][1]))


def _decode(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split :func:`encode` output into ``(tag, body)`` pairs (only used on authenticated plaintext)."""
    out, i = [], 0
    while i < len(data):
        if i + 5 > len(data):
            raise SecAggIntegrityError("truncated share plaintext")
        tag, n = data[i:i + 1], int.from_bytes(data[i + 1:i + 5], "big")
        if i + 5 + n > len(data):
            raise SecAggIntegrityError("truncated share plaintext")
        out.append((tag, data[i + 5:i + 5 + n]))
        i += 5 + n
    return out


def associated_data(session_id: bytes, sender: str, receiver: str) -> bytes:
    """The AEAD associated data binding session, phase, sender and receiver."""
    return encode(DOMAIN, PHASE, session_id, sender, receiver)


def encrypt_share(key: bytes, payload: SharePayload, *, session_id: bytes) -> bytes:
    """Encrypt ``payload`` from ``payload.sender`` to ``payload.receiver`` (see module docstring)."""
    nonce = os.urandom(NONCE_BYTES)
    ad = associated_data(session_id, payload.sender, payload.receiver)
    return nonce + AESGCM(key).encrypt(nonce, payload.to_bytes(), ad)


def decrypt_share(key: bytes, ciphertext: bytes, *, session_id: bytes, sender: str, receiver: str,
                  x: int) -> SharePayload:
    """Decrypt and check a share ciphertext; raises :class:`SecAggIntegrityError` on any mismatch."""
    if len(ciphertext) < NONCE_BYTES + 16:
        raise SecAggIntegrityError(f"share ciphertext from {sender!r} is truncated ({len(ciphertext)} bytes)")
    try:
        plain = AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:],
                                    associated_data(session_id, sender, receiver))
    except InvalidTag as e:
        raise SecAggIntegrityError(
            f"share ciphertext from {sender!r} to {receiver!r} failed authentication (tampered, replayed "
            "from another session or phase, or re-addressed); refusing to continue this session") from e
    payload = SharePayload.from_bytes(plain)
    if (payload.sender, payload.receiver, payload.x) != (sender, receiver, x):
        raise SecAggIntegrityError(
            f"share from {sender!r} names sender {payload.sender!r}, receiver {payload.receiver!r}, x="
            f"{payload.x}; expected {sender!r}, {receiver!r}, x={x}")
    return payload
