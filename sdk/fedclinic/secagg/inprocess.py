"""Run one complete session with in-process clients (simulator, tests, benchmarks): no transport.

``drop`` maps a phase to the clients that go silent *in* that phase and stay silent afterwards:
``Phase.ADVERTISE`` (never advertise), ``Phase.SHARE_KEYS`` (advertised, never share keys),
``Phase.MASKED_INPUT`` (shared keys, never send the masked input), ``Phase.CONSISTENCY`` (sent the masked
input, never attest the survivor set) and ``Phase.UNMASK`` (attested it, never reveal shares).

The clients attest through an :class:`~fedclinic.secagg.attestation.InProcessNotary` (every client is in this
process; no signatures): the services use signed statements instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from fedclinic.secagg.attestation import InProcessNotary
from fedclinic.secagg.client import ClientSession
from fedclinic.secagg.config import MIN_COHORT_FLOOR, ClientPolicy, SessionParams
from fedclinic.secagg.messages import AggregateResult, Phase
from fedclinic.secagg.server import ServerSession


def run_round(params: SessionParams, updates: Mapping[str, np.ndarray], *,
              drop: Mapping[Phase, Iterable[str]] | None = None, policy: ClientPolicy | None = None,
              min_cohort: int = MIN_COHORT_FLOOR, notary: InProcessNotary | None = None) -> AggregateResult:
    """Drive every phase of one session and return the server's :class:`AggregateResult`.

    ``updates`` must hold a vector for every cohort member that reaches the masked-input phase.
    Raises whatever the protocol raises (e.g. :class:`SecAggAbort` below threshold).
    """
    gone: dict[Phase, set[str]] = {ph: set(ids) for ph, ids in (drop or {}).items()}
    silent: set[str] = set()
    notary = notary or InProcessNotary()
    server = ServerSession(params, min_cohort=min_cohort)
    clients = {c: ClientSession(c, params, committed_model_hash=params.model_hash, policy=policy,
                                attestor=notary.for_site(c))
               for c in params.cohort}

    def live(phase: Phase) -> list[str]:
        silent.update(gone.get(phase, ()))
        return [c for c in params.cohort if c not in silent]

    for c in live(Phase.ADVERTISE):
        server.receive_advertise(clients[c].advertise())
    directory = server.close_advertise()
    for c in live(Phase.SHARE_KEYS):
        server.receive_share_keys(clients[c].share_keys(directory))
    requests = server.close_share_keys()
    for c in live(Phase.MASKED_INPUT):
        server.receive_masked_input(clients[c].masked_input(requests[c], updates[c]))
    survivors = server.close_masked_input()
    for c in live(Phase.CONSISTENCY):
        server.receive_survivors_signature(clients[c].sign_survivors(survivors))
    unmask = server.close_consistency()
    for c in live(Phase.UNMASK):
        server.receive_unmask(clients[c].unmask(unmask))
    return server.finish()
