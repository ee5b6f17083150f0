"""The aggregator's side of one secure-aggregation session: route, fold, unmask.

The server sees only masked vectors and, at the end, the sum. It folds each masked vector into one
uint32 accumulator as it arrives (streaming, O(P) memory whatever the cohort), and at the end removes
what does not cancel::

    z = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u) - sum_{v in U2\\U3} sum_{u in N(v) & U3} sign(u,v) PRG(s_uv)
      = sum_{u in U3} q(x_u)                                                   (mod 2^32)

where ``b_u`` is rebuilt from ``t`` self-mask shares of survivor ``u`` and ``s_uv = KA(s_v^SK, s_u^PK)``
from ``t`` mask-key shares of dropped ``v``. Cost: one ring add per survivor (like plain FedAvg) plus
one mask expansion per survivor and per (dropped client, surviving neighbour) pair; the expansions and the
dequantization run as one pass over cache-sized chunks on ``mask_workers`` threads
(:func:`~fedclinic.secagg.masks.apply_masks`).

Consistency (Bonawitz et al.'s malicious-server round 4). After the masked inputs the server sends U3 to every
survivor; each attests it (:class:`~fedclinic.secagg.messages.SurvivorsSignature`); the unmask request carries
every attestation and goes to those that attested (U4), at least ``params.consistency_quorum`` of them. Each
site checks them itself before releasing a share; given an ``attestor``, the server checks them too and refuses a
bad one early (it may not: nothing depends on the server checking).

Dropouts. A client that misses a phase is simply not in the next set (U1 >= U2 >= U3 >= U4 >= U5). After every
phase the server checks that the round can still finish: at least ``max(threshold, min_cohort)``
clients remain, and every client whose secret will be needed still has ``threshold`` live holders.
Otherwise the session aborts with :class:`SecAggAbort` naming the client and the counts.

Restarts. Session state (the accumulator, received shares, the sets) is deliberately not persisted. If
the aggregator restarts mid-protocol the round's secure-aggregation session is lost: the aggregator
starts a new :class:`ServerSession` with a new nonce (new session id), every client creates a new
:class:`~fedclinic.secagg.client.ClientSession` with fresh keys, and the sites re-send their updates.
Unmasking is never re-run for an old session with another survivor set (clients refuse that anyway).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from fedclinic.secagg import shamir
from fedclinic.secagg.attestation import (KEYS_PURPOSE, SURVIVORS_PURPOSE, Attestor, check_attestation, keys_claim,
                                          survivors_claim)
from fedclinic.secagg.config import MIN_COHORT_FLOOR, SessionParams
from fedclinic.secagg.errors import SecAggAbort, SecAggConfigError, SecAggIntegrityError, SecAggProtocolError
from fedclinic.secagg.graph import NeighbourGraph
from fedclinic.secagg.keys import (PAIRWISE_MASK, agree, is_valid_public_key, private_from_bytes, public_bytes,
                                   self_mask_key)
from fedclinic.secagg.masks import MASK_WORKERS, apply_masks
from fedclinic.secagg.messages import (AdvertiseKeys, AggregateResult, KeyDirectory, MaskedInput,
                                       MaskedInputRequest, Phase, ShareKeys, SurvivorsRequest, SurvivorsSignature,
                                       UnmaskRequest, UnmaskResponse)


class ServerSession:
    """The aggregator's state for one session (one round). In memory only; see the module docstring."""

    def __init__(self, params: SessionParams, *, min_cohort: int = MIN_COHORT_FLOOR,
                 mask_workers: int = MASK_WORKERS, attestor: Attestor | None = None) -> None:
        if not isinstance(min_cohort, int) or min_cohort < MIN_COHORT_FLOOR:
            raise SecAggConfigError(f"min_cohort must be >= {MIN_COHORT_FLOOR}")
        if not isinstance(mask_workers, int) or mask_workers < 1:
            raise SecAggConfigError(f"mask_workers must be a positive integer, got {mask_workers!r}")
        if len(params.cohort) < min_cohort:
            raise SecAggConfigError(f"cohort of {len(params.cohort)} is below the minimum of {min_cohort}")
        self.params = params
        self.min_cohort = min_cohort
        self.mask_workers = mask_workers
        #: when given, attestations are checked as they arrive (an early refusal; every site checks them anyway)
        self.attestor = attestor
        self._phase = Phase.ADVERTISE
        self._abort_reason = ""
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._graph: NeighbourGraph | None = None
        self._shares: dict[str, ShareKeys] = {}
        self._u2: tuple[str, ...] = ()
        self._acc: np.ndarray | None = None
        self._u3: set[str] = set()
        self._survivors: SurvivorsRequest | None = None
        self._signatures: dict[str, bytes] = {}
        self._request: UnmaskRequest | None = None
        self._reveals: dict[str, tuple[dict[str, int], dict[str, int]]] = {}

    # -- bookkeeping ---------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def need(self) -> int:
        """Fewest clients that may remain at any phase: ``max(threshold, min_cohort)``."""
        return max(self.params.threshold, self.min_cohort)

    def abort(self, reason: str) -> None:
        """Abandon the session (e.g. deadline passed, aggregator shutting down); frees the accumulator."""
        if self._phase is not Phase.ABORTED:
            self._phase, self._abort_reason, self._acc = Phase.ABORTED, reason, None

    def _fail(self, reason: str) -> SecAggAbort:
        self.abort(reason)
        return SecAggAbort(f"secure-aggregation session {self.params.session_id.hex()[:16]} (task "
                           f"{self.params.task_id!r}, round {self.params.round}) aborted: {reason}; start a new "
                           "session with fresh keys")

    def _enter(self, phase: Phase) -> None:
        if self._phase is Phase.ABORTED:
            raise SecAggAbort(f"session was aborted ({self._abort_reason}); start a new session")
        if self._phase is not phase:
            raise SecAggProtocolError(f"{phase.value} message arrived while the session is in phase "
                                      f"{self._phase.value}")

    def _check(self, session_id: bytes, sender: str, allowed: Collection[str], what: str) -> None:
        if session_id != self.params.session_id:
            raise SecAggProtocolError(f"{what} from {sender!r} carries another session id")
        if sender not in allowed:
            raise SecAggProtocolError(f"{what} from {sender!r}, which is not expected in this phase")

    def _holders_left(self, owners: Iterable[str], live: set[str], label: str) -> None:
        g = self._graph
        assert g is not None
        for u in owners:
            have = len(g.holders(u) & live)
            if have < self.params.threshold:
                raise self._fail(f"only {have} of the share holders of {u!r} are {label}; reconstructing its "
                                 f"secret needs {self.params.threshold}")

    # -- phase 1 -------------------------------------------------------------------------------------

    def receive_advertise(self, msg: AdvertiseKeys) -> None:
        """Record a client's public keys (an identical retry is ignored)."""
        self._enter(Phase.ADVERTISE)
        self._check(msg.session_id, msg.sender, self.params.cohort, "advertise")
        if not (is_valid_public_key(msg.mask_public_key) and is_valid_public_key(msg.encryption_public_key)):
            raise SecAggProtocolError(f"site {msg.sender!r} advertised an invalid X25519 public key")
        if self.attestor is not None:
            failed = check_attestation(self.attestor, KEYS_PURPOSE, keys_claim(msg), msg.attestation, msg.sender)
            if failed is not None:
                raise SecAggProtocolError(f"the keys of {msg.sender!r} are not signed for this session: {failed}")
        old = self._adverts.get(msg.sender)
        if old is not None and old != msg:
            raise SecAggProtocolError(f"site {msg.sender!r} advertised two different key pairs")
        self._adverts[msg.sender] = msg

    def close_advertise(self) -> KeyDirectory:
        """End phase 1 (deadline or all in): U1 = advertisers. Returns the directory to send to U1."""
        self._enter(Phase.ADVERTISE)
        u1 = sorted(self._adverts)
        if len(u1) < self.need:
            raise self._fail(f"only {len(u1)} of {len(self.params.cohort)} sites advertised keys; need {self.need}")
        directory = KeyDirectory(self.params.session_id, tuple(self._adverts[u] for u in u1))
        self._graph = NeighbourGraph.build(u1, self.params.degree, directory.graph_seed())
        self._holders_left(u1, set(u1), "advertised")
        self._phase = Phase.SHARE_KEYS
        return directory

    # -- phase 2 -------------------------------------------------------------------------------------

    def receive_share_keys(self, msg: ShareKeys) -> None:
        """Record a client's encrypted shares; they must address exactly its neighbours."""
        self._enter(Phase.SHARE_KEYS)
        assert self._graph is not None
        self._check(msg.session_id, msg.sender, self._adverts, "share-keys")
        want = self._graph.neighbours(msg.sender)
        if set(msg.ciphertexts) != want:
            raise SecAggProtocolError(f"site {msg.sender!r} sent shares for {sorted(msg.ciphertexts)}, expected its "
                                      f"neighbours {sorted(want)}")
        old = self._shares.get(msg.sender)
        if old is not None and dict(old.ciphertexts) != dict(msg.ciphertexts):
            raise SecAggProtocolError(f"site {msg.sender!r} sent two different share sets")
        self._shares[msg.sender] = msg

    def close_share_keys(self) -> dict[str, MaskedInputRequest]:
        """End phase 2: U2 = clients whose shares arrived. Returns one request per client in U2."""
        self._enter(Phase.SHARE_KEYS)
        g = self._graph
        assert g is not None
        u2 = tuple(sorted(self._shares))
        if len(u2) < self.need:
            raise self._fail(f"only {len(u2)} sites shared keys; need {self.need}")
        self._holders_left(u2, set(u2), "still alive after share-keys")
        self._u2 = u2
        sid = self.params.session_id
        requests = {v: MaskedInputRequest(sid, v, u2, {u: self._shares[u].ciphertexts[v] for u in u2
                                                       if v in g.neighbours(u)})
                    for v in u2}
        self._acc = np.zeros(self.params.vector_length, dtype=self.params.quantizer.dtype)
        self._phase = Phase.MASKED_INPUT
        return requests

    # -- phase 3 -------------------------------------------------------------------------------------

    def receive_masked_input(self, msg: MaskedInput) -> None:
        """Fold a masked vector into the accumulator (mod 2^32). Each client is folded at most once."""
        self._enter(Phase.MASKED_INPUT)
        self._check(msg.session_id, msg.sender, self._u2, "masked input")
        if msg.sender in self._u3:
            raise SecAggProtocolError(f"masked input from {msg.sender!r} was already folded; a retry must be "
                                      "answered from the transport's idempotency record, not folded twice")
        y = msg.masked
        ring = self.params.quantizer.dtype
        if not isinstance(y, np.ndarray) or y.dtype != ring or y.shape != (self.params.vector_length,):
            raise SecAggProtocolError(f"masked input from {msg.sender!r} must be a {ring} vector of "
                                      f"{self.params.vector_length} values")
        assert self._acc is not None
        np.add(self._acc, y, out=self._acc)
        self._u3.add(msg.sender)

    def close_masked_input(self) -> SurvivorsRequest:
        """End phase 3: U3 = clients whose masked input arrived. Returns the survivor set to send to U3."""
        self._enter(Phase.MASKED_INPUT)
        u3 = tuple(sorted(self._u3))
        if len(u3) < self.need:
            raise self._fail(f"only {len(u3)} sites sent masked input; need {self.need}")
        self._holders_left(self._u2, set(u3), "still alive after masked input")
        self._survivors = SurvivorsRequest(self.params.session_id, u3)
        self._phase = Phase.CONSISTENCY
        return self._survivors

    # -- phase 4: consistency ------------------------------------------------------------------------

    def receive_survivors_signature(self, msg: SurvivorsSignature) -> None:
        """Record a survivor's attestation of U3 (an identical retry is ignored)."""
        self._enter(Phase.CONSISTENCY)
        assert self._survivors is not None
        self._check(msg.session_id, msg.sender, self._u3, "survivor-set signature")
        if not msg.attestation:
            raise SecAggProtocolError(f"the survivor-set signature of {msg.sender!r} is empty")
        if self.attestor is not None:
            failed = check_attestation(self.attestor, SURVIVORS_PURPOSE,
                                       survivors_claim(self.params.session_id, self._survivors.survivors),
                                       msg.attestation, msg.sender)
            if failed is not None:
                raise SecAggProtocolError(f"the survivor-set signature of {msg.sender!r} does not hold: {failed}")
        old = self._signatures.get(msg.sender)
        if old is not None and old != msg.attestation:
            raise SecAggProtocolError(f"site {msg.sender!r} signed the survivor set twice, differently")
        self._signatures[msg.sender] = bytes(msg.attestation)

    def close_consistency(self) -> UnmaskRequest:
        """End phase 4: U4 = survivors that attested U3. Returns the unmask request (with every attestation) to
        send to U4; aborts below ``params.consistency_quorum`` attestations."""
        self._enter(Phase.CONSISTENCY)
        assert self._survivors is not None
        u3, u4 = self._survivors.survivors, set(self._signatures)
        need = max(self.params.consistency_quorum, self.need)
        if len(u4) < need:
            raise self._fail(f"only {len(u4)} of {len(u3)} survivors signed the survivor set; need {need}")
        self._holders_left(self._u2, u4, "still alive after the consistency round")
        dropped = tuple(u for u in self._u2 if u not in self._u3)
        self._request = UnmaskRequest(self.params.session_id, self.params.model_hash, u3, dropped,
                                      {s: self._signatures[s] for s in sorted(u4)})
        self._phase = Phase.UNMASK
        return self._request

    # -- phase 5: unmask -----------------------------------------------------------------------------

    def receive_unmask(self, msg: UnmaskResponse) -> None:
        """Record a survivor's revealed shares; they must be exactly the ones the request asked of it."""
        self._enter(Phase.UNMASK)
        g, req = self._graph, self._request
        assert g is not None and req is not None
        self._check(msg.session_id, msg.sender, req.signatures, "unmask response")
        want_self = set(req.survivors) & g.holders(msg.sender)
        want_key = set(req.dropped) & g.neighbours(msg.sender)
        if set(msg.self_mask_shares) != want_self or set(msg.mask_key_shares) != want_key:
            raise SecAggProtocolError(f"unmask response from {msg.sender!r} does not reveal exactly the requested "
                                      "shares")
        decoded = ({o: shamir.decode_share(s) for o, s in msg.self_mask_shares.items()},
                   {o: shamir.decode_share(s) for o, s in msg.mask_key_shares.items()})
        old = self._reveals.get(msg.sender)
        if old is not None and old != decoded:
            raise SecAggProtocolError(f"site {msg.sender!r} revealed two different share sets")
        self._reveals[msg.sender] = decoded

    def _rebuild(self, owner: str, kind: int, what: str) -> bytes:
        p = self.params
        points = {p.x_of(h): r[kind][owner] for h, r in self._reveals.items() if owner in r[kind]}
        if len(points) < p.threshold:
            raise self._fail(f"only {len(points)} holders revealed the {what} shares of {owner!r}; need "
                             f"{p.threshold}")
        try:
            return shamir.int_to_secret(shamir.reconstruct(points, p.threshold))
        except SecAggIntegrityError as e:
            self.abort(str(e))
            raise SecAggIntegrityError(f"{what} of {owner!r}: {e}") from e

    def finish(self) -> AggregateResult:
        """End phase 5 (deadline or all in): rebuild secrets, remove masks, return the survivors' sum."""
        self._enter(Phase.UNMASK)
        p, g, req, acc = self.params, self._graph, self._request, self._acc
        assert g is not None and req is not None and acc is not None
        add: list[bytes] = []
        sub: list[bytes] = []
        for u in req.survivors:
            seed = self._rebuild(u, 0, "self-mask seed")
            sub.append(self_mask_key(seed, session_id=p.session_id, owner=u))
        for v in req.dropped:
            sk = private_from_bytes(self._rebuild(v, 1, "mask private key"))
            if public_bytes(sk) != self._adverts[v].mask_public_key:
                self.abort("reconstructed key mismatch")
                raise SecAggIntegrityError(f"the mask private key rebuilt for {v!r} does not match its advertised "
                                           "public key: some holder revealed a corrupted share")
            for u in sorted(g.neighbours(v) & set(req.survivors)):
                k = agree(sk, self._adverts[u].mask_public_key, session_id=p.session_id, purpose=PAIRWISE_MASK,
                          me=v, peer=u)
                (sub if u > v else add).append(k)  # u added sign(u, v) * PRG(s_uv); take it back out
        m, q = len(req.survivors), p.quantizer
        total = np.empty(acc.size, dtype=np.float32)
        # one pass: each chunk is unmasked and dequantized while it is in cache
        apply_masks(acc, add=add, subtract=sub, workers=self.mask_workers,
                    then=lambda start, part: q.dequantize(part, m, out=total[start:start + part.size]))
        result = AggregateResult(p.session_id, req.survivors, acc, total, float(q.error_bound(m)))
        self._phase, self._acc = Phase.DONE, None
        return result
