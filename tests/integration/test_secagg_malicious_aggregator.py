"""Secure aggregation against a malicious aggregator (issue 17): the real aggregator in the test's process with a
Tamper rewriting the phase messages each site receives (tests/helpers/malicious_aggregator.py), four real agent
processes. Key substitution, sybil entries, a different survivor set per site and both shares of one site: each is
refused by the attacked agents with the reason the task owner sees in the round's declines, and the attacked
sites release no unmask response."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from fedclinic import pki
from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.pki.attestor import CertificateAttestor
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2
from fedclinic.secagg import KEYS_PURPOSE, AdvertiseKeys, keys_claim
from fedclinic.secagg.keys import generate_private_key, public_bytes
from fedclinic.transport.rpc import TlsFiles, secure_channel

from tests.helpers.malicious_aggregator import MaliciousAggregator, Tamper
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package, write_site_data

pytestmark = pytest.mark.integration

SITES = ("site-a", "site-b", "site-c", "site-d")
Attack = Callable[[str, agent_pb2.SecAggPhase], list[agent_pb2.SecAggPhase]]


class SecAggAttacks(Tamper):
    """Rewrites the secure-aggregation phase messages of the task under attack (``attack(site, msg)`` returns what
    the site receives instead) and records every SecAggRespond body each site sends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attack: Attack | None = None
        self.task_id = ""
        self.sent: list[tuple[str, str, str]] = []  # (site, task id, body)
        self.watching: set[str] = set()             # sites that opened a work stream

    def work_item(self, caller, item):
        with self.lock:
            attack, task_id = self.attack, self.task_id
        if item.WhichOneof("item") != "secagg" or attack is None or item.secagg.task_id != task_id:
            return [item]
        msg = agent_pb2.SecAggPhase()
        msg.CopyFrom(item.secagg)
        return [agent_pb2.WorkItem(secagg=m) for m in attack(caller.split()[-1], msg)]

    def request(self, caller, method, request):
        if method.endswith("/WatchWork"):
            with self.lock:
                self.watching.add(caller.split()[-1])
        if method.endswith("/SecAggRespond"):
            with self.lock:
                self.sent.append((caller.split()[-1], request.task_id, request.WhichOneof("body")))
        return request

    def bodies(self, site: str, task_id: str) -> set[str]:
        with self.lock:
            return {body for s, t, body in self.sent if s == site and t == task_id}


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    """Four agents dialing a malicious aggregator; the attacker's own CA with an agent certificate 'site-d'."""
    root = tmp_path_factory.mktemp("secagg-evil")
    sites = [SiteSetup(name, datasets={"notes": {"path": str(write_site_data(root / "data" / name, 24 + 8 * i,
                                                                            seed=i)), "format": "jsonl"}})
             for i, name in enumerate(SITES)]
    fed = LocalFederation(root / "fed", sites, agent_threads=1)
    fed.make_pki()
    pki.init_ca(root / "evil-ca", common_name="attacker CA")
    fake = pki.issue(root / "evil-ca", role="agent", name="site-d", out_dir=root / "evil-site-d", days=2)
    pki.issue(fed.ca_dir, role="agent", name="site-old", out_dir=fed.pki_dir / "site-old", days=2)
    tamper = SecAggAttacks()
    aggregator = MaliciousAggregator(fed, tamper)
    aggregator.start()
    tamper.aggregator = aggregator
    try:
        for site in SITES:
            fed.start_agent(site)
        wait_until(lambda: tamper.watching == set(SITES), 180, "the four agents' work streams")
        yield fed, tamper, CertificateAttestor(ca_path=fake.ca_path, signer=Signer(key_path=fake.key_path,
                                                                                   cert_path=fake.cert_path))
    finally:
        fed.close()
        aggregator.stop()


def _secure_task():
    return make_task(num_rounds=1, min_sites=3, round_timeout_s=60, local_epochs=1, seed=1,
                     secure_aggregation={"enabled": True, "clip": 0.5, "bits": 20})


def _attacked(evil, attack: Attack, refusing: dict[str, str | tuple[str, ...]]) -> None:
    """Run a secure task under ``attack``; each site of ``refusing`` must decline with a reason containing its
    text(s) and send no unmask response."""
    fed, tamper, _ = evil
    with fed.client() as client:
        with tamper.lock:
            tamper.attack, tamper.task_id = attack, "?"
        st = client.submit(_secure_task(), package=tiny_package("logreg"))
        with tamper.lock:
            tamper.task_id = st.task_id  # phase messages start after training and joining: none was missed

        def declines() -> dict[str, str]:
            status = client.status(st.task_id)
            rounds = list(status.rounds)
            return dict(d.split(": ", 1) for d in rounds[0].declined) if rounds else {}

        try:
            wait_until(lambda: set(refusing) <= set(declines()), 180, f"{sorted(refusing)} declining the round")
            seen = declines()
            for site, texts in refusing.items():
                assert seen[site].startswith("secure aggregation refused: "), seen[site]
                for text in (texts,) if isinstance(texts, str) else texts:
                    assert text in seen[site], seen[site]
                assert "unmask_response" not in tamper.bodies(site, st.task_id)
                assert "secure-aggregation session refused" in fed.log_text(f"agent-{site}")
        finally:
            with tamper.lock:
                tamper.attack = None
            try:  # the honest sites may have finished the round without the refusing one
                client.cancel(st.task_id, "attack test over")
            except FedclinicError as exc:
                assert "already ended" in str(exc)


def test_key_substitution_is_refused(evil):
    """site-a's directory carries attacker keys under site-b's name (site-b's signature kept)."""
    mask, enc = public_bytes(generate_private_key()), public_bytes(generate_private_key())

    def attack(site, msg):
        if site == "site-a" and msg.WhichOneof("body") == "key_directory":
            for e in msg.key_directory.entries:
                if e.site_id == "site-b":
                    e.mask_public_key, e.encryption_public_key = mask, enc
        return [msg]

    _attacked(evil, attack, {"site-a": "the keys listed for 'site-b' are not signed by 'site-b' for this session "
                                       "('site-b' signed a different secagg-keys statement"})


def test_sybil_entries_are_refused(evil):
    """site-d is silenced; the attacker answers in its place: to site-a with keys it made, signed by a certificate
    'site-d' of its own CA; to site-b with site-c's genuine keys and statement relabelled 'site-d'; to site-c with
    an extra site outside the cohort."""
    _, _, fake = evil
    mask, enc = public_bytes(generate_private_key()), public_bytes(generate_private_key())

    def attack(site, msg):
        kind = msg.WhichOneof("body")
        if site == "site-d" and kind == "setup":
            return []
        if kind != "key_directory":
            return [msg]
        entries = msg.key_directory.entries
        if site == "site-a":
            keys = AdvertiseKeys(bytes.fromhex(msg.session_id), "site-d", mask, enc)
            statement = task_pb2.SignedStatement.FromString(fake.attest(KEYS_PURPOSE, keys_claim(keys)))
            entries.add(site_id="site-d", mask_public_key=mask, encryption_public_key=enc, keys_statement=statement)
        elif site == "site-b":
            c = next(e for e in entries if e.site_id == "site-c")
            entries.add().CopyFrom(c)
            entries[-1].site_id = "site-d"
        elif site == "site-c":
            entries.add(site_id="sybil-9", mask_public_key=mask, encryption_public_key=enc)
        return [msg]

    _attacked(evil, attack, {
        "site-a": ("the keys listed for 'site-d' are not signed by 'site-d' for this session (the signer's "
                   "certificate (subject ", "site-d", ") was not issued by the CA"),
        "site-b": "the keys listed for 'site-d' are not signed by 'site-d' for this session (the secagg-keys statement "
                  "is signed by the agent 'site-c', not by 'site-d')",
        "site-c": "key directory names sites outside the cohort: ['sybil-9']"})


def test_a_different_survivor_set_per_site_is_refused(evil):
    """site-a is told site-d dropped (survivor set without it, and asked for site-d's mask-key share), the others
    that it survived; the others' unmask requests omit site-a's signature over its other set."""

    def attack(site, msg):
        kind = msg.WhichOneof("body")
        if kind == "survivors_request" and site == "site-a":
            msg.survivors_request.survivors.remove("site-d")
        elif kind == "unmask_request" and site == "site-a":
            r = msg.unmask_request
            r.survivors.remove("site-d")
            r.dropped.append("site-d")
            del r.survivor_signatures["site-d"]
        elif kind == "unmask_request":
            del msg.unmask_request.survivor_signatures["site-a"]
        return [msg]

    _attacked(evil, attack, {"site-a": "the survivor-set signature of 'site-b' does not hold for the survivors "
                                       "['site-a', 'site-b', 'site-c']"})


def test_both_shares_of_one_site_are_refused(evil):
    """Every site signed the same survivor set; site-a alone is then asked to unmask with site-d dropped (its
    mask-key share), while the others reveal site-d's self-mask share."""

    def attack(site, msg):
        if site == "site-a" and msg.WhichOneof("body") == "unmask_request":
            r = msg.unmask_request
            r.survivors.remove("site-d")
            r.dropped.append("site-d")
        return [msg]

    _attacked(evil, attack, {"site-a": "asked to unmask with survivors ['site-a', 'site-b', 'site-c'], but this site "
                                       "attested ['site-a', 'site-b', 'site-c', 'site-d']"})


def test_an_agent_without_signed_keys_is_given_no_secure_task(evil):
    """An agent that announces only the unsigned protocol ("secagg-v1") is not eligible for secure tasks; the
    aggregator tells every agent it speaks "secagg-v2"."""
    fed, tamper, _ = evil
    c = fed.creds("site-old")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        secagg = tamper.aggregator.aggregator.engine.secagg
        for features, capable in ((["secagg-v1"], False), (["secagg-v2"], True)):
            hello = stub.Hello(agent_pb2.HelloRequest(protocol_version=1, capabilities=agent_pb2.Capabilities(
                secure_aggregation=True, features=features)), timeout=30)
            assert "secagg-v2" in hello.features and "secagg-v1" not in hello.features
            assert secagg.capable("site-old") is capable
    finally:
        channel.close()


def test_a_different_input_layout_for_one_site_is_refused(evil):
    """site-a's setup lists an evaluation metric the others' do not (a layout under which its slots would be read
    against the others'): the setup no longer hashes to the session id the others share (the vector length and,
    for layouts of equal length, the layout's digest are part of it: tests/unit/secagg/test_vector_layout.py), so
    site-a refuses it before it shares anything."""

    def attack(site, msg):
        if site == "site-a" and msg.WhichOneof("body") == "setup":
            msg.setup.metric_names.append("zz_injected")
            msg.setup.vector_length += 2  # one metric costs two slots: the length still fits the layout
        return [msg]

    _attacked(evil, attack, {"site-a": "do not hash to its session id"})
