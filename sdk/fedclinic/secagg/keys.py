"""Key agreement (X25519) and key derivation (HKDF-SHA256) for one secure-aggregation session.

Each client makes two fresh X25519 key pairs per session (Bonawitz et al. 2017, round 0):

- the *mask* pair ``(s_u^SK, s_u^PK)``: pairwise mask seeds ``s_{u,v}`` come from it;
- the *encryption* pair ``(c_u^SK, c_u^PK)``: keys that encrypt the Shamir shares sent to peers.

Derivation (RFC 7748 X25519, RFC 5869 HKDF)::

    Z        = X25519(sk_u, pk_v) = X25519(sk_v, pk_u)              (32 bytes, symmetric)
    lo, hi   = sorted((u, v))                                       (canonical order: Python str order)
    key_uv   = HKDF-SHA256(ikm=Z, salt=session_id,
                           info=encode(DOMAIN, purpose, lo, hi), L=32)

``purpose`` is ``"pairwise-mask"`` or ``"share-encryption"``, so the two uses never share a key even if a
client reused a key pair (it does not). Binding the session id (which hashes the task, round, cohort,
model hash and a fresh nonce) makes every key single-use: no mask keystream is ever produced twice
from the same key. Self-mask keys are derived from the 32-byte seed ``b_u`` the same way, with
purpose ``"self-mask"`` and the owner's id.

A zero X25519 output (a low-order peer public key) is rejected by ``cryptography`` and reported as a
:class:`SecAggRefusal` naming the peer.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedclinic.secagg.encoding import DOMAIN, encode
from fedclinic.secagg.errors import SecAggRefusal

KEY_BYTES = 32
"""Length of X25519 public/private keys and of every derived symmetric key."""

PAIRWISE_MASK = "pairwise-mask"
SHARE_ENCRYPTION = "share-encryption"
SELF_MASK = "self-mask"


def generate_private_key() -> X25519PrivateKey:
    """A fresh X25519 private key from the OS CSPRNG."""
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte private key (only ever Shamir-shared, never sent or stored whole)."""
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def private_from_bytes(data: bytes) -> X25519PrivateKey:
    """Load a raw 32-byte X25519 private key (any 32 bytes are valid; X25519 clamps them)."""
    if len(data) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(data)}")
    return X25519PrivateKey.from_private_bytes(data)


def _hkdf(ikm: bytes, *, session_id: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=session_id, info=info).derive(ikm)


def agree(private_key: X25519PrivateKey, peer_public: bytes, *, session_id: bytes, purpose: str,
          me: str, peer: str) -> bytes:
    """The 32-byte symmetric key that ``me`` and ``peer`` share for ``purpose`` in this session.

    ``agree(sk_u, pk_v, u, v) == agree(sk_v, pk_u, v, u)``: the ids enter HKDF in canonical order.
    Raises :class:`SecAggRefusal` if ``peer_public`` is malformed or of low order.
    """
    if purpose not in (PAIRWISE_MASK, SHARE_ENCRYPTION):
        raise ValueError(f"unknown key purpose {purpose!r}")
    if len(peer_public) != KEY_BYTES:
        raise SecAggRefusal(f"client {peer!r} advertised a {len(peer_public)}-byte public key; X25519 keys "
                            f"are {KEY_BYTES} bytes")
    try:
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:  # all-zero shared secret: low-order point
        raise SecAggRefusal(f"client {peer!r} advertised an invalid (low-order) X25519 public key; "
                            "abandon this session") from e
    lo, hi = sorted((me, peer))
    return _hkdf(shared, session_id=session_id, info=encode(DOMAIN, purpose, lo, hi))


def self_mask_key(seed: bytes, *, session_id: bytes, owner: str) -> bytes:
    """The key of client ``owner``'s self mask ``p_u = PRG(b_u)``, from its 32-byte seed ``b_u``."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a self-mask seed is {KEY_BYTES} bytes, got {len(seed)}")
    return _hkdf(seed, session_id=session_id, info=encode(DOMAIN, SELF_MASK, owner))


def is_valid_public_key(data: bytes) -> bool:
    """Whether ``data`` is a 32-byte X25519 public key whose shared secrets are not all-zero.

    Low-order points give the all-zero shared secret with *every* private key, so one trial exchange
    with a throwaway key decides it."""
    if not isinstance(data, bytes) or len(data) != KEY_BYTES:
        return False
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(data))
    except ValueError:
        return False
    return True
