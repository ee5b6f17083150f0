"""Signed secure-aggregation keys and the consistency round, with real certificates of fedclinic's own PKI
(fedclinic.secagg.attestation, fedclinic.pki.attestor): every way a malicious server could rewrite the key
directory or the survivor set is refused by the site before it shares or reveals anything."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from fedclinic import pki
from fedclinic.pki.attestor import CertificateAttestor
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import task_pb2
from fedclinic.secagg import (KEYS_PURPOSE, AdvertiseKeys, ClientSession, InProcessNotary, KeyDirectory, Phase,
                              Quantizer, SecAggAbort, SecAggProtocolError, SecAggRefusal, ServerSession, SessionParams,
                              SurvivorsRequest, UnmaskRequest, keys_claim, run_round)
from fedclinic.secagg.keys import generate_private_key, public_bytes

MODEL = hashlib.sha256(b"global model").digest()
SITES = ("site-00", "site-01", "site-02", "site-03", "site-04")


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    """The federation's CA with five agents and a scientist, and an attacker's own CA with its own 'agents'."""
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "ca", common_name="test CA")
    pki.init_ca(root / "evil-ca", common_name="attacker CA")
    certs = {}
    for name in SITES:
        certs[name] = pki.issue(root / "ca", role="agent", name=name, out_dir=root / name, days=2)
    certs["scientist"] = pki.issue(root / "ca", role="scientist", name="site-09", out_dir=root / "sci", days=2)
    for name in ("sybil-9", "site-01"):
        certs[f"evil:{name}"] = pki.issue(root / "evil-ca", role="agent", name=name, out_dir=root / f"evil-{name}",
                                          days=2)
    return root, certs


def attestor(ca, who):
    root, certs = ca
    c = certs[who]
    return CertificateAttestor(ca_path=root / "ca" / "ca.crt", role="agent",
                               signer=Signer(key_path=c.key_path, cert_path=c.cert_path))


def params(cohort=SITES, **kw):
    return SessionParams("task-1", 2, tuple(cohort), MODEL, 16, quantizer=Quantizer(rounding="nearest"), **kw)


class Run:
    """One session of signed clients, driven step by step so a test can rewrite what the server relays."""

    def __init__(self, ca, p=None):
        self.p = p or params()
        self.server = ServerSession(self.p, attestor=CertificateAttestor(ca_path=ca[0] / "ca" / "ca.crt"))
        self.clients = {c: ClientSession(c, self.p, committed_model_hash=MODEL, attestor=attestor(ca, c))
                        for c in self.p.cohort if c in ca[1]}
        rng = np.random.default_rng(0)
        self.updates = {c: rng.uniform(-1, 1, 16).astype(np.float32) for c in self.p.cohort}

    def directory(self):
        for s in self.clients.values():
            self.server.receive_advertise(s.advertise())
        self.dir = self.server.close_advertise()
        return self.dir

    def to_consistency(self):
        d = self.directory()
        for s in self.clients.values():
            self.server.receive_share_keys(s.share_keys(d))
        reqs = self.server.close_share_keys()
        for c, s in self.clients.items():
            self.server.receive_masked_input(s.masked_input(reqs[c], self.updates[c]))
        return self.server.close_masked_input()


def test_signed_sessions_complete_with_the_exact_sum(ca):
    r = Run(ca)
    surv = r.to_consistency()
    for s in r.clients.values():
        r.server.receive_survivors_signature(s.sign_survivors(surv))
    req = r.server.close_consistency()
    assert sorted(req.signatures) == list(SITES)
    for s in r.clients.values():
        r.server.receive_unmask(s.unmask(req))
    res = r.server.finish()
    want = sum(r.p.quantizer.quantize(r.updates[c]).astype(np.uint64) for c in SITES) % 2 ** 32
    assert np.array_equal(res.quantized_sum, want.astype(np.uint32))


def _replace(d, site, **kw):
    return KeyDirectory(d.session_id, tuple(dataclasses.replace(e, **kw) if e.sender == site else e
                                            for e in d.entries))


def test_key_substitution_is_refused(ca):
    r = Run(ca)
    d = r.directory()
    evil = public_bytes(generate_private_key())
    forged = _replace(d, "site-02", encryption_public_key=evil)  # the attacker's key, site-02's signature
    with pytest.raises(SecAggRefusal, match=r"keys listed for 'site-02' are not signed by 'site-02' .*signed a "
                                            r"different secagg-keys statement.*possible key substitution"):
        r.clients["site-00"].share_keys(forged)
    with pytest.raises(SecAggRefusal, match="already refused"):
        r.clients["site-00"].share_keys(d)  # the session is dead for this site


def test_unsigned_duplicated_and_replayed_entries_are_refused(ca):
    r = Run(ca)
    d = r.directory()
    with pytest.raises(SecAggRefusal, match="'site-03' sent no signature"):
        r.clients["site-00"].share_keys(_replace(d, "site-03", attestation=b""))
    with pytest.raises(SecAggRefusal, match="not a signed statement"):
        r.clients["site-01"].share_keys(_replace(d, "site-03", attestation=b"\xff\x00garbage"))
    genuine = task_pb2.SignedStatement.FromString(next(e for e in d.entries if e.sender == "site-03").attestation)
    bad_sig = task_pb2.SignedStatement()
    bad_sig.CopyFrom(genuine)
    bad_sig.signature = bytes(b ^ 0xFF for b in genuine.signature)  # a forged signature under site-03's certificate
    with pytest.raises(SecAggRefusal, match="signature does not match the data"):
        r.clients["site-04"].share_keys(_replace(d, "site-03", attestation=bad_sig.SerializeToString()))
    bad_cert = task_pb2.SignedStatement()
    bad_cert.CopyFrom(genuine)
    bad_cert.certificate_pem = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    r2 = Run(ca)
    d2 = r2.directory()
    with pytest.raises(SecAggRefusal, match="not a valid PEM X.509 certificate"):
        r2.clients["site-00"].share_keys(_replace(d2, "site-03", attestation=bad_cert.SerializeToString()))
    twice = KeyDirectory(d.session_id, tuple(sorted(d.entries + (d.entries[3],), key=lambda e: e.sender)))
    with pytest.raises(SecAggRefusal, match="lists a site twice"):
        r.clients["site-02"].share_keys(twice)
    # site-04's genuine statement from another session, replayed with its keys into this one
    other = Run(ca, params(nonce=b"\x01" * 16))
    old = other.clients["site-04"].advertise()
    replayed = _replace(d, "site-04", mask_public_key=old.mask_public_key,
                        encryption_public_key=old.encryption_public_key, attestation=old.attestation)
    with pytest.raises(SecAggRefusal, match="'site-04' signed a different secagg-keys statement"):
        r.clients["site-03"].share_keys(replayed)


def test_sybil_entries_are_refused(ca):
    """The server puts a sybil in the cohort and answers its key phase: signed by its own CA, by a real site's
    certificate under the sybil's name, or by a certificate of another role."""
    root, certs = ca
    p = params(SITES + ("sybil-9",))
    r = Run(ca, p)
    for s in r.clients.values():
        r.server.receive_advertise(s.advertise())

    def sybil_entry(signer_cert: str) -> AdvertiseKeys:
        keys = AdvertiseKeys(p.session_id, "sybil-9", public_bytes(generate_private_key()),
                             public_bytes(generate_private_key()))
        c = certs[signer_cert]
        signed = CertificateAttestor(ca_path=c.ca_path, signer=Signer(key_path=c.key_path, cert_path=c.cert_path))
        return dataclasses.replace(keys, attestation=signed.attest(KEYS_PURPOSE, keys_claim(keys)))

    with pytest.raises(SecAggProtocolError, match="not issued by the CA"):
        r.server.receive_advertise(sybil_entry("evil:sybil-9"))  # the server's own check, if it makes it
    honest = tuple(s.advertise() for s in r.clients.values())
    cases = [("evil:sybil-9", "was not issued by the CA"),
             ("site-04", "signed by the agent 'site-04', not by 'sybil-9'"),
             ("scientist", "signer is the scientist 'site-09'")]
    for site, (signer, match) in zip(("site-00", "site-01", "site-02"), cases):
        d = KeyDirectory(p.session_id, tuple(sorted(honest + (sybil_entry(signer),), key=lambda e: e.sender)))
        with pytest.raises(SecAggRefusal, match=r"keys listed for 'sybil-9' are not signed by 'sybil-9'.*" + match):
            r.clients[site].share_keys(d)
    # a real site's name, certified by the attacker's CA
    d = r.server.close_advertise()
    fake = certs["evil:site-01"]
    fake_att = CertificateAttestor(ca_path=fake.ca_path, signer=Signer(key_path=fake.key_path,
                                                                       cert_path=fake.cert_path))
    e = next(e for e in d.entries if e.sender == "site-01")
    keys = dataclasses.replace(e, encryption_public_key=public_bytes(generate_private_key()))
    forged = _replace(d, "site-01", encryption_public_key=keys.encryption_public_key,
                      attestation=fake_att.attest(KEYS_PURPOSE, keys_claim(keys)))
    with pytest.raises(SecAggRefusal, match="'site-01' .*not issued by the CA"):
        r.clients["site-03"].share_keys(forged)


def test_a_cohort_outside_the_tasks_sites_is_refused(ca):
    with pytest.raises(SecAggRefusal, match=r"cohort names sites the task does not admit: \['site-04'\]"):
        ClientSession("site-00", params(), committed_model_hash=MODEL, attestor=attestor(ca, "site-00"),
                      admitted=SITES[:4])


def test_a_different_survivor_set_per_site_is_refused(ca):
    """The server shows site-04 as a survivor to three sites and as dropped to the two others (to get both kinds
    of share of it): no quorum of signatures exists over either set, and a set the site did not sign is refused."""
    r = Run(ca)
    surv = r.to_consistency()
    without = SurvivorsRequest(surv.session_id, tuple(s for s in surv.survivors if s != "site-04"))
    shown = {c: surv if c in SITES[:3] else without for c in SITES[:4]}
    sigs = {c: r.clients[c].sign_survivors(shown[c]) for c in shown}
    assert r.p.consistency_quorum == 4
    with pytest.raises(SecAggProtocolError, match="does not hold"):  # the server's check, if it makes it
        r.server.receive_survivors_signature(sigs["site-03"])
    base = dict(session_id=surv.session_id, model_hash=MODEL)
    # all four signatures under the full set: site-03's is over the other set
    req = UnmaskRequest(**base, survivors=surv.survivors, dropped=(), signatures={c: s.attestation
                                                                                 for c, s in sigs.items()})
    with pytest.raises(SecAggRefusal, match="signature of 'site-03' does not hold for the survivors"):
        r.clients["site-00"].unmask(req)
    # only the honest three: below the quorum
    three = dataclasses.replace(req, signatures={c: sigs[c].attestation for c in SITES[:3]})
    with pytest.raises(SecAggRefusal, match=r"only 3 survivor\(s\) signed the survivor set; .* before 4"):
        r.clients["site-01"].unmask(three)
    # site-03 signed the set without site-04: asked to unmask with site-04 dropped it refuses a quorum it lacks,
    # and asked with the full set (which it did not sign) it refuses that too
    dropped = UnmaskRequest(**base, survivors=without.survivors, dropped=("site-04",),
                            signatures={"site-03": sigs["site-03"].attestation})
    with pytest.raises(SecAggRefusal, match=r"only 1 survivor\(s\) signed the survivor set"):
        r.clients["site-03"].unmask(dropped)
    with pytest.raises(SecAggRefusal, match="second, different survivor set"):
        r.clients["site-02"].sign_survivors(without)
    assert r.clients["site-02"].phase is Phase.ABORTED
    fresh = Run(ca)
    s = fresh.to_consistency()
    a = fresh.clients["site-00"].sign_survivors(s)
    assert fresh.clients["site-00"].sign_survivors(s) is a  # an identical retry gets the identical answer
    sigs = {c: (a if c == "site-00" else fresh.clients[c].sign_survivors(s)).attestation for c in SITES}
    req = UnmaskRequest(**base | {"session_id": s.session_id}, survivors=s.survivors, dropped=(), signatures=sigs)
    with pytest.raises(SecAggRefusal, match="asked to unmask with survivors .* but this site attested"):
        fresh.clients["site-01"].unmask(dataclasses.replace(req, survivors=s.survivors[:4], dropped=s.survivors[4:]))
    with pytest.raises(SecAggRefusal, match="omit or replace this site's own"):
        fresh.clients["site-02"].unmask(dataclasses.replace(req, signatures={c: v for c, v in sigs.items()
                                                                             if c != "site-02"}))
    assert fresh.clients["site-03"].unmask(req).self_mask_shares  # the honest request is answered


def test_the_server_aborts_below_the_consistency_quorum(ca):
    r = Run(ca)
    surv = r.to_consistency()
    for c in SITES[:3]:
        r.server.receive_survivors_signature(r.clients[c].sign_survivors(surv))
    with pytest.raises(SecAggAbort, match="only 3 of 5 survivors signed the survivor set; need 4"):
        r.server.close_consistency()


def test_the_in_process_notary_refuses_what_a_client_did_not_attest():
    p = params()
    notary = InProcessNotary()
    up = {c: np.zeros(16, np.float32) for c in SITES}
    assert run_round(p, up, notary=notary).survivors == SITES
    a, b = notary.for_site("site-00"), notary.for_site("site-01")
    token = a.attest("x", {"k": 1})
    b.check("x", {"k": 1}, token, "site-00")
    for claim, signer, match in [({"k": 2}, "site-00", "another x claim"), ({"k": 1}, "site-01", "made by 'site-00'")]:
        with pytest.raises(Exception, match=match):
            b.check("x", claim, token, signer)
