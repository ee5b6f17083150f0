"""Shamir t-of-n secret sharing over the prime field F_p, p = 2^256 + 297.

Math
----
To share a secret ``s`` in F_p with threshold ``t``, draw ``a_1 .. a_{t-1}`` uniformly from F_p and set
``f(X) = s + a_1 X + ... + a_{t-1} X^{t-1}``. Holder ``i`` gets the point ``(x_i, f(x_i))`` for a public,
non-zero, distinct abscissa ``x_i`` (here: the holder's 1-based position in the sorted cohort).

- *Correctness.* Any ``t`` points determine ``f`` (a Vandermonde system with distinct ``x_i`` is
  invertible), and ``s = f(0) = sum_j y_j * L_j(0)`` with the Lagrange weights
  ``L_j(0) = prod_{m != j} x_m / (x_m - x_j)`` (mod p).
- *Secrecy.* For any ``t-1`` points and *any* candidate secret ``s'`` there is exactly one polynomial of
  degree ``<= t-1`` through ``(0, s')`` and those points. Since ``(a_1 .. a_{t-1})`` is uniform, every
  ``s'`` is equally likely given ``t-1`` shares: they carry no information about ``s``
  (information-theoretic, whatever the adversary's computing power).

Why this prime
--------------
The secrets are 32 bytes: an X25519 private key (any 32 bytes are a valid key) and a 32-byte self-mask
seed. ``p = 2^256 + 297`` is the smallest prime above ``2^256`` (checked by a Miller-Rabin test in the
test suite), so every 32-byte string ``s < 2^256 < p`` embeds injectively as *one* field element: no
splitting into sub-secrets (Google uses 31-bit chunks over 2^31+11), no padding, one share = 33 bytes.
A smaller field such as 2^127-1 would need three chunks per secret and three times the bookkeeping.
Python's big integers make the arithmetic exact; the cost (a few thousand 264-bit multiplications per
secret for tens of holders) is negligible next to mask expansion.

Functions take an optional ``prime`` so that tests can enumerate a tiny field exhaustively; production
code always uses :data:`PRIME`.
"""

from __future__ import annotations

import secrets as _secrets
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from fedclinic.secagg.errors import SecAggIntegrityError

PRIME = (1 << 256) + 297
"""The field modulus: the smallest prime larger than 2^256."""

SECRET_BYTES = 32
"""Length of a secret (an X25519 private key or a self-mask seed)."""

SHARE_BYTES = 33
"""Length of an encoded share value (big-endian, ``< PRIME``)."""


def _check_points(xs: Iterable[int], prime: int, *, holders: bool) -> tuple[int, ...]:
    out = tuple(xs)
    if len(set(x % prime for x in out)) != len(out):
        raise ValueError(f"share abscissas must be distinct mod p, got {sorted(out)}")
    if holders and any(x % prime == 0 for x in out):
        raise ValueError("share abscissa 0 would reveal the secret itself; use x >= 1")
    return out


def split(secret: int, xs: Sequence[int], threshold: int, *, prime: int = PRIME) -> dict[int, int]:
    """Share ``secret`` among the abscissas ``xs`` so that any ``threshold`` of them reconstruct it.

    Returns ``{x: f(x)}``. Coefficients come from :mod:`secrets` (the OS CSPRNG).

    Raises ``ValueError`` when ``secret`` is not in ``[0, prime)``, when ``threshold`` is not in
    ``[1, len(xs)]`` or when abscissas repeat or are 0.
    """
    points = _check_points(xs, prime, holders=True)
    if not 0 <= secret < prime:
        raise ValueError("the secret must be an element of the field, 0 <= secret < p")
    if not 1 <= threshold <= len(points):
        raise ValueError(f"threshold {threshold} must be between 1 and the number of holders {len(points)}")
    coeffs = [secret] + [_secrets.randbelow(prime) for _ in range(threshold - 1)]
    out: dict[int, int] = {}
    for x in points:
        acc = 0
        for c in reversed(coeffs):  # Horner: f(x) = (...(a_{t-1} x + a_{t-2}) x + ...) x + s
            acc = (acc * x + c) % prime
        out[x] = acc
    return out


@lru_cache(maxsize=4096)
def lagrange_weights(xs: tuple[int, ...], at: int = 0, prime: int = PRIME) -> tuple[int, ...]:
    """Weights ``w_j = prod_{m != j} (at - x_m) / (x_j - x_m)`` so that ``f(at) = sum_j w_j f(x_j)``.

    Exact for every polynomial of degree ``< len(xs)``. Cached: with a complete graph every secret is
    reconstructed from the same holder set, so the O(t^2) work is done once per set.
    """
    _check_points(xs, prime, holders=False)
    weights = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * (at - xm) % prime
                den = den * (xj - xm) % prime
        weights.append(num * pow(den, -1, prime) % prime)
    return tuple(weights)


def interpolate(points: Mapping[int, int], at: int = 0, *, prime: int = PRIME) -> int:
    """Value at ``at`` of the unique polynomial of degree ``< len(points)`` through ``points``."""
    xs = tuple(sorted(points))
    weights = lagrange_weights(xs, at % prime, prime)
    return sum(w * points[x] for w, x in zip(weights, xs)) % prime


def reconstruct(shares: Mapping[int, int], threshold: int, *, prime: int = PRIME) -> int:
    """Recover ``f(0)`` from at least ``threshold`` shares ``{x: f(x)}``.

    The ``threshold`` shares with the smallest abscissas define ``f``; every further share is checked to
    lie on it. A share that does not (a corrupted or malicious reveal) raises
    :class:`SecAggIntegrityError`. With exactly ``threshold`` shares no such check is possible.

    Raises ``ValueError`` for fewer than ``threshold`` shares: with ``t-1`` shares the secret is
    undetermined (see the module docstring), so there is nothing to compute.
    """
    if threshold < 1:
        raise ValueError("threshold must be at least 1")
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot reconstruct a {threshold}-of-n secret")
    for x, y in shares.items():
        if not 0 <= y < prime:
            raise SecAggIntegrityError(f"share at x={x} is not a field element")
    xs = sorted(shares)
    base = {x: shares[x] for x in xs[:threshold]}
    for x in xs[threshold:]:
        if interpolate(base, x, prime=prime) != shares[x]:
            raise SecAggIntegrityError(
                f"share at x={x} does not lie on the polynomial of the other shares: a holder revealed a "
                "corrupted share; abandon this session")
    return interpolate(base, 0, prime=prime)


def secret_to_int(secret: bytes) -> int:
    """Embed a 32-byte secret into F_p (big-endian; injective because ``2^256 < p``)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, got {len(secret)}")
    return int.from_bytes(secret, "big")


def int_to_secret(value: int) -> bytes:
    """Inverse of :func:`secret_to_int`; a value ``>= 2^256`` means the shares were not of a secret."""
    if not 0 <= value < (1 << (8 * SECRET_BYTES)):
        raise SecAggIntegrityError(
            "reconstructed value is not a 32-byte secret: the revealed shares are inconsistent")
    return value.to_bytes(SECRET_BYTES, "big")


def encode_share(value: int) -> bytes:
    """A share value as :data:`SHARE_BYTES` big-endian bytes."""
    if not 0 <= value < PRIME:
        raise ValueError("a share value must be a field element")
    return value.to_bytes(SHARE_BYTES, "big")


def decode_share(data: bytes) -> int:
    """Parse :func:`encode_share` output; rejects wrong lengths and values ``>= p``."""
    if len(data) != SHARE_BYTES:
        raise SecAggIntegrityError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise SecAggIntegrityError("share value is not a field element (>= p)")
    return value
