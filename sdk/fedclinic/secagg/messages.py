"""The protocol's messages, as plain typed records (the gRPC layer maps each one to a proto message).

Phases and sets (Bonawitz et al. 2017 notation; U1 >= U2 >= U3 >= U4)::

    0 setup        server -> cohort  SessionParams
    1 advertise    client -> server  AdvertiseKeys         (U1 = clients that advertised)
                   server -> U1      KeyDirectory
    2 share keys   client -> server  ShareKeys             (U2 = clients that sent encrypted shares)
                   server -> u in U2 MaskedInputRequest    (the ciphertexts addressed to u, and U2)
    3 masked input client -> server  MaskedInput           (U3 = clients whose masked vector arrived)
                   server -> U3      SurvivorsRequest      (U3)
    4 consistency  client -> server  SurvivorsSignature    (U4 = clients that attested U3)
                   server -> U4      UnmaskRequest         (survivors = U3, dropped = U2 \\ U3, the U4 attestations)
    5 unmask       client -> server  UnmaskResponse        (U5 = clients that revealed shares)
                   server            AggregateResult

``payload_bytes()`` counts the bytes of the fields (ids as UTF-8, keys, ciphertexts, vectors), i.e. what
the messages cost on the wire before protobuf framing. ``attestation`` fields are opaque bytes made and checked by
the site's :class:`~fedclinic.secagg.attestation.Attestor` (signed statements in the services).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from fedclinic.secagg.encoding import DOMAIN, encode


class Phase(str, Enum):
    """Where a session is. A session only moves forward; ABORTED and DONE are final."""

    ADVERTISE = "advertise"
    SHARE_KEYS = "share-keys"
    MASKED_INPUT = "masked-input"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"
    DONE = "done"
    ABORTED = "aborted"


def _ids(ids: Iterable[str]) -> int:
    return sum(len(i.encode()) for i in ids)


@dataclass(frozen=True)
class AdvertiseKeys:
    """Phase 1, client -> server: the two fresh X25519 public keys of ``sender``, and ``sender``'s attestation of
    them (:func:`~fedclinic.secagg.attestation.keys_claim`). Equality compares the keys, not the attestation."""

    session_id: bytes
    sender: str
    mask_public_key: bytes
    encryption_public_key: bytes
    attestation: bytes = field(default=b"", repr=False, compare=False)

    def payload_bytes(self) -> int:
        return len(self.session_id) + len(self.sender.encode()) + 64 + len(self.attestation)


@dataclass(frozen=True)
class KeyDirectory:
    """Phase 1, server -> U1: every advertised key pair, sorted by sender."""

    session_id: bytes
    entries: tuple[AdvertiseKeys, ...]

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(e.sender for e in self.entries)

    def graph_seed(self) -> bytes:
        """SHA-256 over the session id and every (id, mask key, encryption key): the graph's seed.

        Every client computes it itself, so all agree on the graph, and it depends on all keys."""
        parts = [DOMAIN, "graph-seed", self.session_id, len(self.entries)]
        for e in self.entries:
            parts += [e.sender, e.mask_public_key, e.encryption_public_key]
        return hashlib.sha256(encode(*parts)).digest()

    def payload_bytes(self) -> int:
        return len(self.session_id) + sum(e.payload_bytes() - len(e.session_id) for e in self.entries)


@dataclass(frozen=True)
class ShareKeys:
    """Phase 2, client -> server: one AEAD ciphertext of shares per neighbour, keyed by recipient."""

    session_id: bytes
    sender: str
    ciphertexts: Mapping[str, bytes]

    def payload_bytes(self) -> int:
        return (len(self.session_id) + len(self.sender.encode()) + _ids(self.ciphertexts)
                + sum(len(c) for c in self.ciphertexts.values()))


@dataclass(frozen=True)
class MaskedInputRequest:
    """Phase 2 -> 3, server -> u: the ciphertexts addressed to ``recipient`` (keyed by sender) and U2."""

    session_id: bytes
    recipient: str
    alive: tuple[str, ...]
    ciphertexts: Mapping[str, bytes]

    def payload_bytes(self) -> int:
        return (len(self.session_id) + len(self.recipient.encode()) + _ids(self.alive) + _ids(self.ciphertexts)
                + sum(len(c) for c in self.ciphertexts.values()))


@dataclass(frozen=True)
class MaskedInput:
    """Phase 3, client -> server: ``y_u = q(x_u) + PRG(b_u) + sum_v sign(u,v) PRG(s_uv)  (mod 2^32)``."""

    session_id: bytes
    sender: str
    masked: np.ndarray = field(repr=False)

    def payload_bytes(self) -> int:
        return len(self.session_id) + len(self.sender.encode()) + int(self.masked.nbytes)


@dataclass(frozen=True)
class SurvivorsRequest:
    """Phase 3 -> 4, server -> U3: the survivor set U3 (sorted), for each survivor to attest."""

    session_id: bytes
    survivors: tuple[str, ...]

    def payload_bytes(self) -> int:
        return len(self.session_id) + _ids(self.survivors)


@dataclass(frozen=True)
class SurvivorsSignature:
    """Phase 4 (consistency), client -> server: ``sender``'s attestation of
    :func:`~fedclinic.secagg.attestation.survivors_claim` (session id, U3)."""

    session_id: bytes
    sender: str
    attestation: bytes = field(repr=False)

    def payload_bytes(self) -> int:
        return len(self.session_id) + len(self.sender.encode()) + len(self.attestation)


@dataclass(frozen=True)
class UnmaskRequest:
    """Phase 4 -> 5, server -> U4: who survived (reveal their self-mask shares) and who dropped after
    sharing keys (reveal their mask-key shares), the model hash the round committed to, and the survivors'
    attestations of exactly ``survivors`` (signer -> attestation) from the consistency round."""

    session_id: bytes
    model_hash: bytes
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    signatures: Mapping[str, bytes] = field(default_factory=dict, repr=False)

    def payload_bytes(self) -> int:
        return (len(self.session_id) + len(self.model_hash) + _ids(self.survivors) + _ids(self.dropped)
                + _ids(self.signatures) + sum(len(a) for a in self.signatures.values()))


@dataclass(frozen=True)
class UnmaskResponse:
    """Phase 5, client -> server: for each peer exactly one kind of share, keyed by the share's owner."""

    session_id: bytes
    sender: str
    self_mask_shares: Mapping[str, bytes]
    mask_key_shares: Mapping[str, bytes]

    def payload_bytes(self) -> int:
        return (len(self.session_id) + len(self.sender.encode())
                + sum(len(k.encode()) + len(v) for k, v in self.self_mask_shares.items())
                + sum(len(k.encode()) + len(v) for k, v in self.mask_key_shares.items()))


@dataclass(frozen=True)
class AggregateResult:
    """The server's output: the exact ring sum of the survivors' quantized inputs and its float value.

    ``total`` is the dequantized float32 sum (not the mean; the strategy divides); every coordinate is
    within ``error_bound`` of the sum of the survivors' clipped float inputs.
    """

    session_id: bytes
    survivors: tuple[str, ...]
    quantized_sum: np.ndarray = field(repr=False)
    total: np.ndarray = field(repr=False)
    error_bound: float
