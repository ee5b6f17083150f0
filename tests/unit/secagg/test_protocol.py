"""The SecAgg/SecAgg+ protocol end to end: exact sums, dropouts at every phase, aborts, client refusals,
server-side checks (fedclinic.secagg.client/server/inprocess)."""

import dataclasses
import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.secagg import (ClientPolicy, ClientSession, InProcessNotary, MaskedInput, NeighbourGraph, Phase, Quantizer,
                              SecAggAbort, SecAggConfigError, SecAggInputError, SecAggIntegrityError,
                              SecAggProtocolError, SecAggRefusal, ServerSession, SessionParams, UnmaskRequest,
                              run_round, suggested_degree)
from fedclinic.secagg.keys import self_mask_key
from fedclinic.secagg.masks import MIN_PIECE_WORDS, expand_mask
from fedclinic.secagg.messages import AdvertiseKeys, KeyDirectory

MODEL = hashlib.sha256(b"global model round 3").digest()
NEAREST = Quantizer(clip=1.0, bits=20, rounding="nearest")
NOTARY = InProcessNotary()


def session(site, params, **kw):
    """A ClientSession attesting through the module's in-process notary."""
    kw.setdefault("committed_model_hash", MODEL)
    return ClientSession(site, params, attestor=NOTARY.for_site(site), **kw)


def make_params(n=7, *, length=64, degree=None, threshold=0, quantizer=NEAREST, cohort=None):
    cohort = tuple(cohort or (f"site-{i:02d}" for i in range(n)))
    return SessionParams("task-1", 3, cohort, MODEL, length, quantizer=quantizer, degree=degree,
                         threshold=threshold)


def make_updates(params, seed=0):
    rng = np.random.default_rng(seed)
    return {c: rng.uniform(-1, 1, params.vector_length).astype(np.float32) for c in params.cohort}


def expected_ring_sum(params, updates, survivors):
    total = np.zeros(params.vector_length, np.uint32)
    for c in survivors:
        total += params.quantizer.quantize(updates[c])  # nearest rounding: deterministic
    return total


class Run:
    """Step-by-step driver for tests that intercept messages between phases."""

    def __init__(self, params, policy=None):
        self.p = params
        self.server = ServerSession(params)
        self.clients = {c: session(c, params, policy=policy) for c in params.cohort}
        self.updates = make_updates(params)

    def to_share_keys(self):
        for c, s in self.clients.items():
            self.server.receive_advertise(s.advertise())
        self.directory = self.server.close_advertise()
        return self.directory

    def to_masked_input(self):
        d = self.to_share_keys()
        for s in self.clients.values():
            self.server.receive_share_keys(s.share_keys(d))
        self.requests = self.server.close_share_keys()
        return self.requests

    def consistency(self, signers=None):
        """Close the masked-input phase, let ``signers`` (default: every survivor) attest U3; the unmask request."""
        self.survivors_request = self.server.close_masked_input()
        for c in signers or self.survivors_request.survivors:
            self.server.receive_survivors_signature(self.clients[c].sign_survivors(self.survivors_request))
        self.unmask_request = self.server.close_consistency()
        return self.unmask_request

    def to_unmask(self):
        reqs = self.to_masked_input()
        for c, s in self.clients.items():
            self.server.receive_masked_input(s.masked_input(reqs[c], self.updates[c]))
        return self.consistency()


# -- exactness ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,degree", [(3, None), (7, None), (12, 4), (20, 6)])
def test_masks_cancel_exactly(n, degree):
    """Pairwise masks cancel: sum of all masked inputs minus the self masks PRG(b_u) == sum of the
    quantized inputs (mod 2^32), bit for bit; and the server's output is exactly that sum."""
    p = make_params(n, length=1000, degree=degree)
    up = make_updates(p, seed=n)
    r = Run(p)
    r.updates = up
    r.to_masked_input()
    masked = {c: s.masked_input(r.requests[c], up[c]) for c, s in r.clients.items()}
    plain = {c: p.quantizer.quantize(up[c]) for c in p.cohort}
    ring = np.zeros(p.vector_length, np.uint32)
    for m in masked.values():
        ring += m.masked
    for c, s in r.clients.items():  # the self masks, from each client's (private) seed b_u
        ring -= expand_mask(self_mask_key(s._seed, session_id=p.session_id, owner=c), p.vector_length)
    assert np.array_equal(ring, expected_ring_sum(p, up, p.cohort))
    for c in p.cohort:  # and no single masked vector resembles its input
        assert np.mean(masked[c].masked == plain[c]) < 0.01
    for m in masked.values():
        r.server.receive_masked_input(m)
    req = r.consistency()
    for c, s in r.clients.items():
        r.server.receive_unmask(s.unmask(req))
    res = r.server.finish()
    assert np.array_equal(res.quantized_sum, expected_ring_sum(p, up, p.cohort))
    assert r.server.phase is Phase.DONE


def _drop_strategy(n, t):
    return st.lists(st.integers(0, n - 1), max_size=n - t, unique=True)


@settings(max_examples=12, deadline=None)
@given(phase=st.sampled_from([Phase.ADVERTISE, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.CONSISTENCY,
                              Phase.UNMASK]),
       data=st.data())
def test_dropout_of_up_to_n_minus_t_at_any_phase_gives_exact_sum(phase, data):
    p = make_params(8, length=257)  # complete graph, t = ceil(16/3) = 6: up to 2 dropouts
    up = make_updates(p)
    idx = data.draw(_drop_strategy(8, p.threshold))
    gone = [p.cohort[i] for i in idx]
    res = run_round(p, up, drop={phase: gone})
    survivors = [c for c in p.cohort if phase in (Phase.CONSISTENCY, Phase.UNMASK) or c not in gone]
    assert res.survivors == tuple(survivors)
    assert np.array_equal(res.quantized_sum, expected_ring_sum(p, up, survivors))


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_dropouts_spread_over_all_phases(data):
    p = make_params(10, length=100)  # t = 7: 3 dropouts in total
    up = make_updates(p, seed=1)
    order = data.draw(st.permutations(p.cohort))
    cuts = data.draw(st.lists(st.sampled_from(list(Phase)[:5]), min_size=3, max_size=3))
    drop = {}
    for c, ph in zip(order[:3], cuts):
        drop.setdefault(ph, []).append(c)
    res = run_round(p, up, drop=drop)
    masked_gone = {c for ph, cs in drop.items() if ph not in (Phase.CONSISTENCY, Phase.UNMASK) for c in cs}
    survivors = [c for c in p.cohort if c not in masked_gone]
    assert np.array_equal(res.quantized_sum, expected_ring_sum(p, up, survivors))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 16), phase=st.sampled_from([Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK]))
def test_secagg_plus_sparse_graph_with_dropouts(seed, phase):
    """SecAgg+: degree 6 over 24 clients (t = 5 of 7 holders); drop 2 random clients in one phase."""
    p = make_params(24, length=50, degree=6)
    assert p.holders == 7 and p.threshold == 5
    up = make_updates(p, seed=seed)
    gone = list(np.random.default_rng(seed).choice(p.cohort, 2, replace=False))
    res = run_round(p, up, drop={phase: gone})
    survivors = [c for c in p.cohort if phase is Phase.UNMASK or c not in gone]
    assert np.array_equal(res.quantized_sum, expected_ring_sum(p, up, survivors))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 10), data=st.data())
def test_complete_graph_succeeds_exactly_when_enough_clients_remain(n, data):
    """Any dropout pattern: the round returns the exact sum of U3 iff every phase kept
    max(t, min_cohort) clients (U1, U2, U3) and t revealed shares (U4); otherwise it aborts."""
    h = n
    t = data.draw(st.integers(h // 2 + 1, h).filter(lambda v: v >= 2))
    p = make_params(n, length=33, threshold=t)
    phases = [Phase.ADVERTISE, Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK]
    when = data.draw(st.lists(st.sampled_from([None, *phases]), min_size=n, max_size=n))
    drop = {ph: [c for c, w in zip(p.cohort, when) if w is ph] for ph in phases}
    left, sets = set(p.cohort), []
    for ph in phases:
        left -= set(drop[ph])
        sets.append(set(left))
    need = max(t, 3)
    feasible = all(len(u) >= need for u in sets[:3]) and len(sets[3]) >= t
    up = make_updates(p, seed=n)
    if feasible:
        res = run_round(p, up, drop=drop)
        assert set(res.survivors) == sets[2]
        assert np.array_equal(res.quantized_sum, expected_ring_sum(p, up, sorted(sets[2])))
    else:
        with pytest.raises(SecAggAbort):
            run_round(p, up, drop=drop)


@pytest.mark.parametrize("phase,match", [
    (Phase.ADVERTISE, "advertised keys"), (Phase.SHARE_KEYS, "shared keys"),
    (Phase.MASKED_INPUT, "sent masked input"), (Phase.CONSISTENCY, "signed the survivor set"),
    (Phase.UNMASK, "revealed the self-mask seed")])
def test_too_many_dropouts_abort_with_a_clear_error(phase, match):
    p = make_params(7)  # t = 5
    gone = list(p.cohort[:3])
    with pytest.raises(SecAggAbort, match=match) as err:
        run_round(p, make_updates(p), drop={phase: gone})
    assert "start a new session" in str(err.value)


def test_sparse_neighbourhood_below_threshold_aborts_and_names_the_client():
    p = make_params(24, length=8, degree=6)
    r = Run(p)
    r.to_share_keys()
    g = NeighbourGraph.build(r.directory.members, 6, r.directory.graph_seed())
    victim = p.cohort[0]
    lost = sorted(g.neighbours(victim))[:3]  # 3 of its 7 holders gone -> 4 < t = 5
    for c, s in r.clients.items():
        if c not in lost:
            r.server.receive_share_keys(s.share_keys(r.directory))
    with pytest.raises(SecAggAbort, match=f"holders of '{victim}'"):
        r.server.close_share_keys()
    with pytest.raises(SecAggAbort, match="aborted"):
        r.server.close_share_keys()


def test_end_to_end_floats_within_documented_bound():
    """8 in-process hospitals, 3000-float updates, stochastic rounding, one dropout after share-keys and
    one during unmasking: the float result equals the plain float sum of the survivors within the bound."""
    q = Quantizer(clip=0.5, bits=20)
    p = make_params(8, length=3000, quantizer=q)
    rng = np.random.default_rng(7)
    up = {c: (rng.standard_normal(3000) * 0.1).astype(np.float32) for c in p.cohort}
    res = run_round(p, up, drop={Phase.MASKED_INPUT: ["site-03"], Phase.UNMASK: ["site-06"]})
    survivors = [c for c in p.cohort if c != "site-03"]
    assert res.survivors == tuple(survivors)
    plain = np.sum([np.clip(up[c].astype(np.float64), -0.5, 0.5) for c in survivors], axis=0)
    err = np.abs(res.total.astype(np.float64) - plain)
    assert res.total.dtype == np.float32 and res.total.shape == (3000,)
    assert np.all(err <= q.error_bound(len(survivors), plain))
    assert err.max() <= res.error_bound == q.error_bound(7)
    assert res.error_bound < 1e-5


@pytest.mark.parametrize("mask_workers", [1, 2])
def test_threaded_masking_and_unmasking_give_the_exact_sum(mask_workers):
    """A vector long enough for the clients to mask and the server to unmask and dequantize on worker threads,
    with one site dropped after share-keys (its pairwise masks are expanded too): the exact ring sum of the
    survivors (a wrongly expanded mask piece would not cancel)."""
    p = make_params(4, length=2 * MIN_PIECE_WORDS + 3)
    r = Run(p)
    r.server = ServerSession(p, mask_workers=mask_workers)
    for client in r.clients.values():
        client.mask_workers = mask_workers
    reqs = r.to_masked_input()
    survivors = [c for c in p.cohort if c != "site-02"]
    for c in survivors:
        r.server.receive_masked_input(r.clients[c].masked_input(reqs[c], r.updates[c]))
    unmask = r.consistency()
    for c in survivors:
        r.server.receive_unmask(r.clients[c].unmask(unmask))
    res = r.server.finish()
    want = expected_ring_sum(p, r.updates, survivors)
    assert res.survivors == tuple(survivors) and np.array_equal(res.quantized_sum, want)
    assert np.array_equal(res.total, p.quantizer.dequantize(want, len(survivors)))


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_mask_workers_must_be_a_positive_integer(workers):
    p = make_params(3)
    with pytest.raises(SecAggConfigError, match="mask_workers must be a positive integer"):
        session(p.cohort[0], p, mask_workers=workers)


def test_server_never_holds_both_shares_of_one_client():
    p = make_params(9, length=16)
    r = Run(p)
    r.to_masked_input()
    gone = {"site-02", "site-05"}
    for c, s in r.clients.items():
        if c not in gone:
            r.server.receive_masked_input(s.masked_input(r.requests[c], r.updates[c]))
    req = r.consistency()
    self_owners, key_owners = set(), set()
    for c, s in r.clients.items():
        if c not in gone:
            resp = s.unmask(req)
            self_owners |= set(resp.self_mask_shares)
            key_owners |= set(resp.mask_key_shares)
    assert key_owners == gone and self_owners == set(p.cohort) - gone
    assert not self_owners & key_owners


# -- client refusals ----------------------------------------------------------------------------------

def test_refuses_both_shares_of_the_same_client_in_one_request():
    r = Run(make_params(7))
    req = r.to_unmask()
    attack = dataclasses.replace(req, dropped=("site-03",))  # site-03 is also a survivor
    with pytest.raises(SecAggRefusal, match=r"both the self-mask share and the mask-key share of \['site-03'\]"):
        r.clients["site-00"].unmask(attack)
    with pytest.raises(SecAggRefusal, match="already refused"):
        r.clients["site-00"].unmask(req)  # a refused session is dead


def test_refuses_a_second_different_unmask_request_but_answers_an_identical_retry():
    r = Run(make_params(7))
    req = r.to_unmask()
    first = r.clients["site-01"].unmask(req)
    assert r.clients["site-01"].unmask(req) is first
    # the attack across two requests: now claim site-04 dropped to get its mask-key share too
    second = UnmaskRequest(req.session_id, MODEL, tuple(c for c in req.survivors if c != "site-04"), ("site-04",))
    with pytest.raises(SecAggRefusal, match="second, different unmask request"):
        r.clients["site-01"].unmask(second)


@pytest.mark.parametrize("survivors,dropped,match", [
    (("site-00", "site-01", "site-02", "site-03", "site-04", "site-05", "site-06", "site-99"), (),
     "outside the cohort"),
    (("site-00", "site-01", "site-02", "site-03", "site-04", "site-05"), (), "partition"),
    (("site-01", "site-02", "site-03", "site-04", "site-05", "site-06"), ("site-00",), "lists this site as dropped"),
    (("site-00", "site-02", "site-01", "site-03", "site-04", "site-05", "site-06"), (), "sorted"),
    (("site-00", "site-01", "site-02", "site-03"), ("site-04", "site-05", "site-06"), "only 4 survivors"),
])
def test_refuses_inconsistent_survivor_and_dropped_sets(survivors, dropped, match):
    r = Run(make_params(7))
    req = r.to_unmask()
    with pytest.raises(SecAggRefusal, match=match):
        r.clients["site-00"].unmask(dataclasses.replace(req, survivors=survivors, dropped=dropped))


def test_refuses_a_model_hash_other_than_the_committed_one():
    p = make_params(5)
    with pytest.raises(SecAggRefusal, match="model-inconsistency"):
        session("site-00", p, committed_model_hash=hashlib.sha256(b"other").digest())
    r = Run(p)
    req = r.to_unmask()
    with pytest.raises(SecAggRefusal, match="unmask request names model"):
        r.clients["site-00"].unmask(dataclasses.replace(req, model_hash=hashlib.sha256(b"other").digest()))


def test_refuses_cohorts_below_the_site_minimum_and_weak_thresholds():
    p = make_params(4)
    with pytest.raises(SecAggRefusal, match="below this site's minimum of 5"):
        session("site-00", p, policy=ClientPolicy(min_cohort=5))
    with pytest.raises(SecAggRefusal, match="not in the session's cohort"):
        session("site-77", p)
    weak = make_params(9, threshold=5)  # 5 of 9 is a majority, but not above 2/3
    with pytest.raises(SecAggRefusal, match="minimum fraction 0.666"):
        session("site-00", weak, policy=ClientPolicy(min_threshold_fraction=2 / 3))
    with pytest.raises(SecAggRefusal, match="mask with only 4 neighbours"):
        session("site-00", make_params(20, degree=4, threshold=4), policy=ClientPolicy(min_degree=6))


def test_refuses_survivor_sets_below_the_site_minimum():
    p = make_params(7, threshold=4)
    r = Run(p, policy=ClientPolicy(min_cohort=6))
    req = r.to_unmask()
    small = dataclasses.replace(req, survivors=req.survivors[:5], dropped=req.survivors[5:])
    with pytest.raises(SecAggRefusal, match="only 5 survivors.*at least 6"):
        r.clients["site-00"].unmask(small)


def test_refuses_tampered_key_directories():
    r = Run(make_params(5))
    d = r.to_share_keys()
    me = "site-01"
    forged = [e if e.sender != me else dataclasses.replace(e, mask_public_key=d.entries[0].mask_public_key)
              for e in d.entries]
    with pytest.raises(SecAggRefusal, match="replaces this site's own keys"):
        r.clients[me].share_keys(KeyDirectory(d.session_id, tuple(forged)))
    outsider = AdvertiseKeys(d.session_id, "site-zz", d.entries[0].mask_public_key, d.entries[0].encryption_public_key)
    with pytest.raises(SecAggRefusal, match="outside the cohort"):
        r.clients["site-02"].share_keys(KeyDirectory(d.session_id, d.entries + (outsider,)))
    low = [e if e.sender != "site-04" else dataclasses.replace(e, encryption_public_key=bytes(32)) for e in d.entries]
    with pytest.raises(SecAggRefusal, match="invalid X25519"):
        r.clients["site-03"].share_keys(KeyDirectory(d.session_id, tuple(low)))
    with pytest.raises(SecAggRefusal, match="only 3 sites advertised"):
        r.clients["site-00"].share_keys(KeyDirectory(d.session_id, d.entries[:3]))


def test_tampered_or_misrouted_share_ciphertexts_are_refused():
    r = Run(make_params(5))
    reqs = r.to_masked_input()
    req = reqs["site-00"]
    cts = dict(req.ciphertexts)
    ct = bytearray(cts["site-01"])
    ct[-1] ^= 0x01
    cts["site-01"] = bytes(ct)
    with pytest.raises(SecAggIntegrityError, match="from 'site-01' to 'site-00' failed authentication"):
        r.clients["site-00"].masked_input(dataclasses.replace(req, ciphertexts=cts), r.updates["site-00"])
    # a ciphertext meant for site-02, handed to site-03 as if it were addressed to it
    req3 = reqs["site-03"]
    swapped = {**req3.ciphertexts, "site-01": reqs["site-02"].ciphertexts["site-01"]}
    with pytest.raises(SecAggIntegrityError, match="failed authentication"):
        r.clients["site-03"].masked_input(dataclasses.replace(req3, ciphertexts=swapped), r.updates["site-03"])
    missing = {k: v for k, v in reqs["site-04"].ciphertexts.items() if k != "site-00"}
    with pytest.raises(SecAggRefusal, match="exactly the alive neighbours"):
        r.clients["site-04"].masked_input(dataclasses.replace(reqs["site-04"], ciphertexts=missing),
                                          r.updates["site-04"])
    with pytest.raises(SecAggRefusal, match="omits this site"):
        r.clients["site-01"].masked_input(
            dataclasses.replace(reqs["site-01"], alive=tuple(c for c in reqs["site-01"].alive if c != "site-01")),
            r.updates["site-01"])


def test_messages_from_another_session_are_refused():
    """An aggregator restart means a new session (new nonce -> new id); the old client state is useless."""
    p = make_params(5)
    r = Run(p)
    r.to_share_keys()
    p2 = dataclasses.replace(p, nonce=os.urandom(16))
    assert p2.session_id != p.session_id
    r2 = Run(p2)
    d2 = r2.to_share_keys()
    with pytest.raises(SecAggRefusal, match="another session id"):
        r.clients["site-00"].share_keys(d2)


def test_out_of_order_calls_kill_the_client_session():
    r = Run(make_params(5))
    s = r.clients["site-00"]
    with pytest.raises(SecAggProtocolError, match="arrived in phase advertise"):
        s.unmask(UnmaskRequest(r.p.session_id, MODEL, r.p.cohort, ()))
    with pytest.raises(SecAggRefusal, match="already refused"):
        s.advertise()


def test_client_rejects_bad_update_vectors():
    r = Run(make_params(5, length=10))
    reqs = r.to_masked_input()
    with pytest.raises(SecAggInputError, match="10 values"):
        r.clients["site-00"].masked_input(reqs["site-00"], np.zeros(11, np.float32))
    bad = np.zeros(10, np.float32)
    bad[3] = np.inf
    with pytest.raises(SecAggInputError, match="index 3"):
        r.clients["site-01"].masked_input(reqs["site-01"], bad)


# -- server-side checks -------------------------------------------------------------------------------

def test_server_rejects_malformed_and_duplicate_messages():
    r = Run(make_params(5, length=10))
    s0 = r.clients["site-00"]
    adv = s0.advertise()
    with pytest.raises(SecAggProtocolError, match="another session id"):
        r.server.receive_advertise(dataclasses.replace(adv, session_id=bytes(32)))
    with pytest.raises(SecAggProtocolError, match="not expected"):
        r.server.receive_advertise(dataclasses.replace(adv, sender="site-zz"))
    with pytest.raises(SecAggProtocolError, match="invalid X25519"):
        r.server.receive_advertise(dataclasses.replace(adv, mask_public_key=bytes(32)))
    r.server.receive_advertise(adv)
    r.server.receive_advertise(adv)  # identical retry is fine
    with pytest.raises(SecAggProtocolError, match="two different key pairs"):
        other = r.clients["site-01"].advertise().mask_public_key
        r.server.receive_advertise(dataclasses.replace(adv, mask_public_key=other))
    with pytest.raises(SecAggProtocolError, match="arrived while the session is in phase advertise"):
        r.server.close_share_keys()


def test_server_folds_each_masked_input_once_and_checks_shape():
    r = Run(make_params(5, length=10))
    reqs = r.to_masked_input()
    m = r.clients["site-00"].masked_input(reqs["site-00"], r.updates["site-00"])
    with pytest.raises(SecAggProtocolError, match="uint32 vector of 10"):
        r.server.receive_masked_input(MaskedInput(m.session_id, m.sender, m.masked.astype(np.int64)))
    r.server.receive_masked_input(m)
    with pytest.raises(SecAggProtocolError, match="already folded"):
        r.server.receive_masked_input(m)


def test_server_detects_a_corrupted_revealed_share():
    r = Run(make_params(7))
    req = r.to_unmask()
    for c, s in r.clients.items():
        resp = s.unmask(req)
        if c == "site-02":  # a malicious holder lies about its share of site-00's self-mask seed
            bad = int.from_bytes(resp.self_mask_shares["site-00"], "big") ^ 1
            resp = dataclasses.replace(resp, self_mask_shares={**resp.self_mask_shares,
                                                               "site-00": bad.to_bytes(33, "big")})
        r.server.receive_unmask(resp)
    with pytest.raises(SecAggIntegrityError, match="self-mask seed of 'site-00'"):
        r.server.finish()


def test_server_rejects_responses_that_reveal_unrequested_shares():
    r = Run(make_params(5))
    req = r.to_unmask()
    resp = r.clients["site-00"].unmask(req)
    extra = dataclasses.replace(resp, mask_key_shares={"site-01": resp.self_mask_shares["site-01"]})
    with pytest.raises(SecAggProtocolError, match="exactly the requested"):
        r.server.receive_unmask(extra)


# -- parameters ---------------------------------------------------------------------------------------

def test_session_parameter_validation():
    with pytest.raises(SecAggConfigError, match="2\\*t > 7"):
        make_params(7, threshold=3)
    with pytest.raises(SecAggConfigError, match="even integer"):
        make_params(20, degree=5)
    with pytest.raises(SecAggConfigError, match="wrap"):
        make_params(300, quantizer=Quantizer(bits=24))
    with pytest.raises(SecAggConfigError, match="distinct"):
        make_params(cohort=("a", "b", "a"))
    with pytest.raises(SecAggConfigError, match="minimum of 3"):
        ServerSession(make_params(2))
    with pytest.raises(SecAggConfigError, match="mask_workers"):
        ServerSession(make_params(3), mask_workers=0)
    with pytest.raises(SecAggConfigError, match=">= 3"):
        ClientPolicy(min_cohort=2)
    p = make_params(10)
    assert (p.holders, p.threshold, p.tolerated_dropouts) == (10, 7, 3)
    sparse = make_params(100, degree=suggested_degree(100))
    assert suggested_degree(100) == 14 and sparse.holders == 15 and sparse.threshold == 10
    assert suggested_degree(5) is None and suggested_degree(10) == 8  # None: complete is as sparse


def test_graph_is_regular_symmetric_and_seeded():
    members = [f"s{i:03d}" for i in range(50)]
    g = NeighbourGraph.build(members, 8, b"seed-1")
    assert all(len(g.neighbours(m)) == 8 for m in members)
    assert all(u in g.neighbours(v) for u in members for v in g.neighbours(u))
    assert g == NeighbourGraph.build(list(reversed(members)), 8, b"seed-1")
    assert g.adjacency != NeighbourGraph.build(members, 8, b"seed-2").adjacency
    assert NeighbourGraph.build(members, 60, b"x").is_complete
