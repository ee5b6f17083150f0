"""The site's side of one secure-aggregation session (one round), with the checks that refuse.

Usage, one :class:`ClientSession` per round (the gRPC layer carries the messages)::

    s = ClientSession("site-a", params, committed_model_hash=sha256_of_the_model_we_trained_on,
                      attestor=site_attestor)        # signs this site's claims, checks its peers'
    adv = s.advertise()                              # -> server (keys + this site's attestation of them)
    shares = s.share_keys(directory)                 # KeyDirectory from the server -> ShareKeys
    masked = s.masked_input(request, update_vector)  # MaskedInputRequest -> MaskedInput
    signed = s.sign_survivors(survivors_request)     # SurvivorsRequest -> SurvivorsSignature (consistency)
    reveal = s.unmask(unmask_request)                # UnmaskRequest (+ the survivors' attestations) -> UnmaskResponse

What a client computes (u = this site, v over its neighbours that completed share-keys)::

    y_u = q(x_u) + PRG(b_u) + sum_v sign(u, v) PRG(s_uv)    (mod 2^32),  sign(u, v) = +1 if u > v else -1

so the pairwise masks of two survivors cancel in the sum, and the self mask PRG(b_u) hides y_u even if
the server later learns u's pairwise masks (u declared dropped, its masked input arriving late).

Refusals (:class:`SecAggRefusal`, after which every call raises again):

- at creation: the site is not in the cohort; the cohort names a site the task does not admit (``admitted``,
  the task's site allow-list); the cohort is smaller than ``policy.min_cohort``; the
  threshold is not above ``policy.min_threshold_fraction`` of the holders; the graph degree is below
  ``policy.min_degree``; the session's model hash is not the one this site committed to (trained on);
- at share-keys: the key directory drops or replaces this site's keys, names sites outside the cohort or
  one site twice, carries invalid keys, carries keys that their site did not attest for this session
  (unsigned, signed by a foreign CA or another certificate, or substituted: the attestor's check), or has
  fewer members than ``max(threshold, min_cohort)``;
- at masked-input: the alive set is not a subset of the advertised set, omits this site, is too small,
  or the ciphertexts do not come from exactly this site's alive neighbours; a ciphertext fails
  authentication (:class:`SecAggIntegrityError`);
- at consistency (Bonawitz et al.'s round 4): the survivor set is not a sorted subset of the alive set, omits
  this site or is too small; or a second, different survivor set arrives (a site attests one set per session);
- at unmask: the request names another model hash; survivors and dropped sets overlap (*the classic
  attack: asking for both the self-mask share and the mask-key share of one client*); they are not
  subsets of the cohort or do not partition the alive set; this site is listed as dropped; fewer
  survivors than ``max(threshold, min_cohort)``; or a second unmask request differs from the first
  (an identical retry gets the identical answer); the survivors are not exactly the set this site attested;
  the attestations carried are fewer than ``params.consistency_quorum``, omit this site's own, come from
  sites outside the survivor set, or any one of them does not hold (no share is released before all pass).

State lives in memory only (private keys, self-mask seed, received shares) and is never persisted: a
restarted agent cannot resume a session and simply counts as dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import TypeVar

import numpy as np

from fedclinic.errors import FedclinicError
from fedclinic.secagg import shamir
from fedclinic.secagg.attestation import (KEYS_PURPOSE, SURVIVORS_PURPOSE, Attestor, check_attestation, keys_claim,
                                          survivors_claim)
from fedclinic.secagg.config import ClientPolicy, SessionParams
from fedclinic.secagg.errors import (SecAggConfigError, SecAggError, SecAggInputError, SecAggProtocolError,
                                     SecAggRefusal)
from fedclinic.secagg.graph import NeighbourGraph
from fedclinic.secagg.keys import (PAIRWISE_MASK, SHARE_ENCRYPTION, agree, generate_private_key,
                                   is_valid_public_key, private_bytes, public_bytes, self_mask_key)
from fedclinic.secagg.masks import MASK_WORKERS, apply_masks
from fedclinic.secagg.messages import (AdvertiseKeys, KeyDirectory, MaskedInput, MaskedInputRequest, Phase,
                                       ShareKeys, SurvivorsRequest, SurvivorsSignature, UnmaskRequest, UnmaskResponse)
from fedclinic.secagg.share_crypto import SharePayload, decrypt_share, encrypt_share


_T = TypeVar("_T")


class ClientSession:
    """One site's state for one session. Create a new one per round; never reuse or persist it.

    ``attestor`` attests this site's keys and survivor set and checks its peers' (the services: signed statements
    under the fedclinic CA). ``admitted``, when given, is every site the task admits (its allow-list): a cohort
    naming another is refused."""

    def __init__(self, site_id: str, params: SessionParams, *, committed_model_hash: bytes, attestor: Attestor,
                 policy: ClientPolicy | None = None, mask_workers: int = MASK_WORKERS,
                 admitted: Collection[str] | None = None) -> None:
        if not isinstance(mask_workers, int) or isinstance(mask_workers, bool) or mask_workers < 1:
            raise SecAggConfigError(f"mask_workers must be a positive integer, got {mask_workers!r}")
        #: threads that expand this site's masks over disjoint parts of its vector (the result does not depend on it)
        self.mask_workers = mask_workers
        self.site_id = site_id
        self.params = params
        self.policy = policy or ClientPolicy()
        self._committed = committed_model_hash
        self._attestor = attestor
        self._admitted = None if admitted is None else frozenset(admitted)
        self._dead: str | None = None
        self._phase = Phase.ADVERTISE
        self._check_params()
        self._mask_sk = generate_private_key()
        self._enc_sk = generate_private_key()
        keys = AdvertiseKeys(params.session_id, site_id, public_bytes(self._mask_sk), public_bytes(self._enc_sk))
        self._advert = AdvertiseKeys(keys.session_id, site_id, keys.mask_public_key, keys.encryption_public_key,
                                     self._attest(KEYS_PURPOSE, keys_claim(keys)))
        self._directory: dict[str, AdvertiseKeys] = {}
        self._graph: NeighbourGraph | None = None
        self._seed: bytes | None = None
        self._held: dict[str, SharePayload] = {}   # owner -> shares of owner's secrets held by this site
        self._alive: tuple[str, ...] = ()
        self._signed: tuple[SurvivorsRequest, SurvivorsSignature] | None = None
        self._answer: tuple[UnmaskRequest, UnmaskResponse] | None = None

    # -- helpers -------------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return Phase.ABORTED if self._dead else self._phase

    def _refuse(self, reason: str) -> SecAggRefusal:
        self._dead = reason
        return SecAggRefusal(f"site {self.site_id!r} refuses session {self.params.session_id.hex()[:16]}: "
                             f"{reason}")

    def _enter(self, *phases: Phase) -> None:
        if self._dead:
            raise SecAggRefusal(f"site {self.site_id!r} already refused this session ({self._dead}); the "
                                "aggregator must start a new session")
        if self._phase not in phases:
            self._dead = f"out-of-order request in phase {self._phase.value}"
            raise SecAggProtocolError(f"site {self.site_id!r}: request for phase(s) "
                                      f"{[p.value for p in phases]} arrived in phase {self._phase.value}; "
                                      "the session is abandoned")

    def _guarded(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a phase; any protocol error kills the session (nothing is answered after an error)."""
        try:
            return fn(*args)
        except SecAggError as e:
            self._dead = self._dead or str(e)
            raise

    def _attest(self, purpose: str, claim: dict[str, object]) -> bytes:
        try:
            return self._attestor.attest(purpose, claim)
        except FedclinicError as exc:
            self._dead = f"cannot attest its {purpose} claim"
            raise SecAggConfigError(f"site {self.site_id!r} cannot sign its {purpose} statement: {exc}") from None

    def _check_session(self, session_id: bytes) -> None:
        if session_id != self.params.session_id:
            raise self._refuse("message carries another session id (replayed or misrouted)")

    def _check_params(self) -> None:
        p, pol = self.params, self.policy
        if self.site_id not in p.cohort:
            raise self._refuse("this site is not in the session's cohort")
        foreign = sorted(set(p.cohort) - self._admitted) if self._admitted is not None else []
        if foreign:
            raise self._refuse(f"the cohort names sites the task does not admit: {foreign} (the task's sites are "
                               f"{sorted(self._admitted or ())}); possible sybil sites")
        if not isinstance(self._committed, bytes) or len(self._committed) != 32:
            raise self._refuse("committed_model_hash must be the 32-byte SHA-256 of the model trained on")
        if p.model_hash != self._committed:
            raise self._refuse(f"the session names model {p.model_hash.hex()[:16]}, but this site committed "
                               f"to (trained on) {self._committed.hex()[:16]}: possible model-inconsistency attack")
        if len(p.cohort) < pol.min_cohort:
            raise self._refuse(f"cohort of {len(p.cohort)} sites is below this site's minimum of {pol.min_cohort}")
        if p.threshold <= pol.min_threshold_fraction * p.holders:
            raise self._refuse(f"threshold {p.threshold} of {p.holders} share holders is not above this site's "
                               f"minimum fraction {pol.min_threshold_fraction:g}")
        if p.holders - 1 < pol.min_degree:
            raise self._refuse(f"each site would mask with only {p.holders - 1} neighbours; this site requires "
                               f"at least {pol.min_degree}")

    # -- phase 1 -------------------------------------------------------------------------------------

    def advertise(self) -> AdvertiseKeys:
        """Phase 1: this site's two fresh public keys (an identical retry gets the same keys)."""
        self._enter(Phase.ADVERTISE, Phase.SHARE_KEYS)
        self._phase = Phase.SHARE_KEYS
        return self._advert

    # -- phase 2 -------------------------------------------------------------------------------------

    def share_keys(self, directory: KeyDirectory) -> ShareKeys:
        """Phase 2: Shamir-share the mask private key and a fresh self-mask seed among this site's
        holders and encrypt each neighbour's shares to it."""
        self._enter(Phase.SHARE_KEYS)
        return self._guarded(self._share_keys, directory)

    def _share_keys(self, directory: KeyDirectory) -> ShareKeys:
        p, me = self.params, self.site_id
        self._check_session(directory.session_id)
        members = directory.members
        if list(members) != sorted(set(members)):
            raise self._refuse("key directory is not sorted or lists a site twice")
        outside = sorted(set(members) - set(p.cohort))
        if outside:
            raise self._refuse(f"key directory names sites outside the cohort: {outside}")
        entries = {e.sender: e for e in directory.entries}
        if len(entries) != len(directory.entries):
            raise self._refuse("key directory lists a site twice")
        if entries.get(me) != self._advert:
            raise self._refuse("key directory omits or replaces this site's own keys")
        need = max(p.threshold, self.policy.min_cohort)
        if len(members) < need:
            raise self._refuse(f"only {len(members)} sites advertised keys; this site needs at least {need} "
                               "(threshold and minimum cohort)")
        for e in directory.entries:
            if e.session_id != p.session_id:
                raise self._refuse(f"keys of {e.sender!r} belong to another session")
            if not (is_valid_public_key(e.mask_public_key) and is_valid_public_key(e.encryption_public_key)):
                raise self._refuse(f"site {e.sender!r} advertised an invalid X25519 public key")
            if e.sender != me:
                failed = check_attestation(self._attestor, KEYS_PURPOSE, keys_claim(e), e.attestation, e.sender)
                if failed is not None:
                    raise self._refuse(f"the keys listed for {e.sender!r} are not signed by {e.sender!r} for this "
                                       f"session ({failed}): possible key substitution or sybil entry")
        graph = NeighbourGraph.build(members, p.degree, directory.graph_seed())
        holders = sorted(graph.holders(me))
        if len(holders) < p.threshold:
            raise self._refuse(f"only {len(holders)} share holders for threshold {p.threshold}")
        if graph.degree < self.policy.min_degree:
            raise self._refuse(f"graph gives this site {graph.degree} neighbours; it requires {self.policy.min_degree}")
        self._directory, self._graph = entries, graph
        self._seed = os.urandom(shamir.SECRET_BYTES)
        xs = [p.x_of(h) for h in holders]
        b_shares = shamir.split(shamir.secret_to_int(self._seed), xs, p.threshold)
        sk_shares = shamir.split(shamir.secret_to_int(private_bytes(self._mask_sk)), xs, p.threshold)
        cts: dict[str, bytes] = {}
        for h in holders:
            x = p.x_of(h)
            payload = SharePayload(me, h, x, b_shares[x], sk_shares[x])
            if h == me:
                self._held[me] = payload  # own share stays here
                continue
            key = agree(self._enc_sk, entries[h].encryption_public_key, session_id=p.session_id,
                        purpose=SHARE_ENCRYPTION, me=me, peer=h)
            cts[h] = encrypt_share(key, payload, session_id=p.session_id)
        self._phase = Phase.MASKED_INPUT
        return ShareKeys(p.session_id, me, cts)

    # -- phase 3 -------------------------------------------------------------------------------------

    def masked_input(self, request: MaskedInputRequest, update: np.ndarray) -> MaskedInput:
        """Phase 3: decrypt the shares addressed to this site, then quantize ``update`` and mask it."""
        self._enter(Phase.MASKED_INPUT)
        return self._guarded(self._masked_input, request, update)

    def _masked_input(self, request: MaskedInputRequest, update: np.ndarray) -> MaskedInput:
        p, me, graph = self.params, self.site_id, self._graph
        assert graph is not None and self._seed is not None
        arr = np.asarray(update)
        encoded = arr.dtype == p.quantizer.dtype  # already in the ring (fedclinic.secagg.vector_layout)
        if arr.ndim != 1 or not (arr.dtype.kind == "f" or encoded) or arr.size != p.vector_length:
            raise SecAggInputError(f"update must be a 1-D float vector (or {p.quantizer.dtype}, already encoded) "
                                   f"of {p.vector_length} values, got shape {arr.shape} dtype {arr.dtype}")
        self._check_session(request.session_id)
        if request.recipient != me:
            raise self._refuse(f"request is addressed to {request.recipient!r}")
        alive = tuple(request.alive)
        if list(alive) != sorted(set(alive)):
            raise self._refuse("alive set is not sorted or lists a site twice")
        extra = sorted(set(alive) - set(graph.members))
        if extra:
            raise self._refuse(f"alive set names sites that never advertised keys: {extra}")
        if me not in alive:
            raise self._refuse("alive set omits this site although it shared its keys")
        need = max(p.threshold, self.policy.min_cohort)
        if len(alive) < need:
            raise self._refuse(f"only {len(alive)} sites shared keys; this site needs at least {need}")
        partners = graph.neighbours(me) & set(alive)
        got = set(request.ciphertexts)
        if got != partners:
            raise self._refuse(f"expected shares from exactly the alive neighbours {sorted(partners)}, got "
                               f"{sorted(got)}")
        if len(partners) + 1 < p.threshold:
            raise self._refuse(f"only {len(partners) + 1} holders of this site's shares are alive; the "
                               f"threshold is {p.threshold}")
        for v in sorted(partners):
            key = agree(self._enc_sk, self._directory[v].encryption_public_key, session_id=p.session_id,
                        purpose=SHARE_ENCRYPTION, me=me, peer=v)
            self._held[v] = decrypt_share(key, request.ciphertexts[v], session_id=p.session_id, sender=v,
                                          receiver=me, x=p.x_of(me))
        q = arr.copy() if encoded else p.quantizer.quantize(arr).astype(p.quantizer.dtype, copy=False)
        add = [self_mask_key(self._seed, session_id=p.session_id, owner=me)]
        sub = []
        for v in sorted(partners):
            k = agree(self._mask_sk, self._directory[v].mask_public_key, session_id=p.session_id,
                      purpose=PAIRWISE_MASK, me=me, peer=v)
            (add if me > v else sub).append(k)
        apply_masks(q, add=add, subtract=sub, workers=self.mask_workers)
        self._alive = alive
        self._phase = Phase.CONSISTENCY
        return MaskedInput(p.session_id, me, q)

    # phase 4: consistency ---------------------------------------------------------------------------

    def sign_survivors(self, request: SurvivorsRequest) -> SurvivorsSignature:
        """Phase 4 (consistency): attest the survivor set U3. A site attests one set per session: an identical
        retry gets the identical answer, a different set is refused."""
        if self._signed is not None and not self._dead:
            first, answer = self._signed
            if request == first:
                return answer
            raise self._refuse(
                f"a second, different survivor set {list(request.survivors)} after attesting "
                f"{list(first.survivors)}: the aggregator may be showing sites different survivor sets")
        self._enter(Phase.CONSISTENCY)
        return self._guarded(self._sign_survivors, request)

    def _sign_survivors(self, request: SurvivorsRequest) -> SurvivorsSignature:
        p, me = self.params, self.site_id
        self._check_session(request.session_id)
        surv = tuple(request.survivors)
        if list(surv) != sorted(set(surv)):
            raise self._refuse("survivor set is not sorted or lists a site twice")
        extra = sorted(set(surv) - set(self._alive))
        if extra:
            raise self._refuse(f"survivor set names sites that did not share keys: {extra}")
        if me not in surv:
            raise self._refuse("the survivor set omits this site although it sent its masked input")
        need = max(p.threshold, self.policy.min_cohort)
        if len(surv) < need:
            raise self._refuse(f"only {len(surv)} survivors; revealing their sum needs at least {need} "
                               "(threshold and minimum cohort)")
        answer = SurvivorsSignature(p.session_id, me, self._attest(SURVIVORS_PURPOSE, survivors_claim(p.session_id,
                                                                                                      surv)))
        self._signed = (request, answer)
        self._phase = Phase.UNMASK
        return answer

    # -- phase 4 -------------------------------------------------------------------------------------

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Phase 4: reveal, per peer, exactly one share: of the self-mask seed if it survived, of the
        mask private key if it dropped after sharing keys. Answers one request per session."""
        if self._answer is not None and not self._dead:
            first, response = self._answer
            if request == first:
                return response
            raise self._refuse(
                f"a second, different unmask request (survivors={list(request.survivors)}, dropped="
                f"{list(request.dropped)}) after answering survivors={list(first.survivors)}, dropped="
                f"{list(first.dropped)}: together they could reveal both shares of a client")
        self._enter(Phase.UNMASK)
        return self._guarded(self._unmask, request)

    def _unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        p, me, graph = self.params, self.site_id, self._graph
        assert graph is not None
        self._check_session(request.session_id)
        if request.model_hash != self._committed:
            raise self._refuse(f"unmask request names model {request.model_hash.hex()[:16]}, not the committed "
                               f"{self._committed.hex()[:16]}")
        surv, drop = tuple(request.survivors), tuple(request.dropped)
        both = sorted(set(surv) & set(drop))
        if both:
            raise self._refuse(f"the server asks for both the self-mask share and the mask-key share of {both}; "
                               "survivor and dropped sets must be disjoint")
        if list(surv) != sorted(set(surv)) or list(drop) != sorted(set(drop)):
            raise self._refuse("survivor or dropped set is not sorted or lists a site twice")
        outside = sorted((set(surv) | set(drop)) - set(p.cohort))
        if outside:
            raise self._refuse(f"survivor/dropped sets name sites outside the cohort: {outside}")
        if set(surv) | set(drop) != set(self._alive):
            raise self._refuse(
                f"survivors and dropped must partition the sites that shared keys {list(self._alive)}; got "
                f"unknown {sorted((set(surv) | set(drop)) - set(self._alive))}, missing "
                f"{sorted(set(self._alive) - set(surv) - set(drop))}")
        if me not in surv:
            raise self._refuse("the server lists this site as dropped although it sent its masked input")
        need = max(p.threshold, self.policy.min_cohort)
        if len(surv) < need:
            raise self._refuse(f"only {len(surv)} survivors; revealing their sum needs at least {need} "
                               "(threshold and minimum cohort)")
        self._check_consistency(request)
        held = self._held
        self_shares = {o: shamir.encode_share(held[o].self_mask_share) for o in surv if o in held}
        key_shares = {o: shamir.encode_share(held[o].mask_key_share) for o in drop if o in held}
        response = UnmaskResponse(p.session_id, me, self_shares, key_shares)
        self._answer = (request, response)
        self._phase = Phase.DONE
        # the secrets are no longer needed; drop them
        self._seed = None
        self._held = {}
        return response

    def _check_consistency(self, request: UnmaskRequest) -> None:
        """The unmask request's survivors are the set this site attested, and a quorum of survivors attested it."""
        p, me = self.params, self.site_id
        assert self._signed is not None
        mine = self._signed[0].survivors
        if tuple(request.survivors) != tuple(mine):
            raise self._refuse(f"asked to unmask with survivors {list(request.survivors)}, but this site attested "
                               f"{list(mine)}: the aggregator is showing sites different survivor sets")
        sigs = dict(request.signatures)
        outside = sorted(set(sigs) - set(mine))
        if outside:
            raise self._refuse(f"survivor-set signatures from sites outside the survivor set: {outside}")
        if sigs.get(me) != self._signed[1].attestation:
            raise self._refuse("the survivor-set signatures omit or replace this site's own")
        claim = survivors_claim(p.session_id, mine)
        for signer in sorted(sigs):
            if signer == me:
                continue
            failed = check_attestation(self._attestor, SURVIVORS_PURPOSE, claim, sigs[signer], signer)
            if failed is not None:
                raise self._refuse(f"the survivor-set signature of {signer!r} does not hold for the survivors "
                                   f"{list(mine)} ({failed}): the aggregator may be showing sites different "
                                   "survivor sets")
        if len(sigs) < p.consistency_quorum:
            raise self._refuse(f"only {len(sigs)} survivor(s) signed the survivor set; this site releases no share "
                               f"before {p.consistency_quorum} have (consistency round)")
