"""Secure aggregation: SecAgg+ (Bell et al., CCS 2020) with SecAgg (Bonawitz et al., CCS 2017) as the
complete-graph case. A transport-free library: the gRPC layer carries the messages.

The aggregator learns ``sum_{u in survivors} q(x_u) mod 2^r`` (r = 16, 32 or 64) and nothing else about the individual
quantized updates ``q(x_u)`` (and, with signed keys and the consistency round, an active server cannot
substitute keys, add sybils or show sites different survivor sets; see SECURITY.md for what it can still do).
Modules, one job each:

=================  =====================================================================================
``config``         :class:`SessionParams` (cohort, threshold, graph degree, quantizer, model hash, nonce)
                   and the site's :class:`ClientPolicy`
``quantize``       fixed-point :class:`Quantizer` into Z_{2^r} with a stated error bound; ``ring_for``
``vector_layout``  one input's slots: weighted quantized delta, weights (per tensor under SAFL) and
                   evaluation metrics, and their decoding into weighted means
``shamir``         t-of-n Shamir sharing over F_p, p = 2^256 + 297
``keys``           X25519 key pairs, HKDF-SHA256 derivations bound to session and client ids
``share_crypto``   AES-256-GCM encryption of shares, AD = (session, phase, sender, receiver)
``masks``          AES-256-CTR mask expansion into uint16/32/64 vectors, applied in place
``graph``          complete graph or seeded random k-regular Harary graph
``messages``       the phase messages
``attestation``    what sites attest (keys, survivor set) and the :class:`Attestor` interface that signs/checks
``client``         :class:`ClientSession`: one site, one round, with the refusing checks
``server``         :class:`ServerSession`: routing, streaming fold, dropout recovery, unmasking
``inprocess``      :func:`run_round`: every phase in one process (simulator, tests, benchmarks)
=================  =====================================================================================
"""

from fedclinic.secagg.attestation import (KEYS_PURPOSE, SURVIVORS_PURPOSE, Attestor, InProcessNotary, keys_claim,
                                          survivors_claim)
from fedclinic.secagg.client import ClientSession
from fedclinic.secagg.config import ClientPolicy, SessionParams, default_threshold
from fedclinic.secagg.errors import (SecAggAbort, SecAggConfigError, SecAggError, SecAggInputError,
                                     SecAggIntegrityError, SecAggProtocolError, SecAggRefusal)
from fedclinic.secagg.graph import NeighbourGraph, suggested_degree
from fedclinic.secagg.inprocess import run_round
from fedclinic.secagg.messages import (AdvertiseKeys, AggregateResult, KeyDirectory, MaskedInput,
                                       MaskedInputRequest, Phase, ShareKeys, SurvivorsRequest, SurvivorsSignature,
                                       UnmaskRequest, UnmaskResponse)
from fedclinic.secagg.quantize import Quantizer
from fedclinic.secagg.server import ServerSession

__all__ = [
    "KEYS_PURPOSE", "SURVIVORS_PURPOSE", "Attestor", "InProcessNotary", "SurvivorsRequest", "SurvivorsSignature",
    "keys_claim", "survivors_claim",
    "AdvertiseKeys", "AggregateResult", "ClientPolicy", "ClientSession", "KeyDirectory", "MaskedInput",
    "MaskedInputRequest", "NeighbourGraph", "Phase", "Quantizer", "SecAggAbort", "SecAggConfigError",
    "SecAggError", "SecAggInputError", "SecAggIntegrityError", "SecAggProtocolError", "SecAggRefusal",
    "ServerSession", "SessionParams", "ShareKeys", "UnmaskRequest", "UnmaskResponse", "default_threshold",
    "run_round", "suggested_degree",
]
