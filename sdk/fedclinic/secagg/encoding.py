"""Canonical, injective byte encoding for everything that is hashed, fed to HKDF or authenticated.

``encode(p1, p2, ...)`` writes, for each part, a one-byte type tag (``b`` bytes, ``s`` UTF-8 string,
``i`` unsigned 64-bit integer, ``f`` IEEE-754 binary64), a 4-byte big-endian length and the body. The
encoding is prefix-free, so two different tuples of parts never encode to the same bytes: a session id,
an HKDF ``info`` string or an AEAD associated-data string cannot be confused with one built from
other values (no ``"ab" + "c" == "a" + "bc"`` ambiguity).
"""

from __future__ import annotations

import struct

DOMAIN = "fedclinic-secagg/v1"
"""Domain-separation prefix of every hash, key-derivation and associated-data string of this protocol."""

_U64 = 1 << 64


def encode(*parts: bytes | str | int | float) -> bytes:
    """Encode ``parts`` as ``tag || len32 || body`` each; see the module docstring."""
    out = bytearray()
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("booleans are not encodable; use 0/1 explicitly")
        if isinstance(part, bytes):
            tag, body = b"b", part
        elif isinstance(part, str):
            tag, body = b"s", part.encode("utf-8")
        elif isinstance(part, int):
            if not 0 <= part < _U64:
                raise ValueError(f"integer {part} is outside the encodable range [0, 2^64)")
            tag, body = b"i", part.to_bytes(8, "big")
        elif isinstance(part, float):
            tag, body = b"f", struct.pack(">d", part)
        else:
            raise TypeError(f"cannot encode a {type(part).__name__}")
        out += tag + len(body).to_bytes(4, "big") + body
    return bytes(out)
