"""Verifiable rounds over real processes: every site signs a round statement with its update, the aggregator keeps
them with the round, and ``fedclinic task verify`` checks a task's records against them. An honest task verifies
(plain with published updates, and secure aggregation); a malicious aggregator (tests/helpers/malicious_aggregator.py)
that gives one site another model (a split view) or publishes a model nobody aggregated is named by verify; a
statement that is not the calling site's, or does not match its update, is refused at upload."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest

from fedclinic.cli import main as fedclinic_main
from hospital_agent.cli import main as agent_main
from fedclinic.client import state_name
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.transport.package import Manifest, TensorEntry, raw_bytes, tensor_sha256
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.transport.wire import manifest_to_proto
from fedclinic.verification.round_statement import sign_header
from fedclinic.verification.site_records import SiteRecords
from fedclinic.verification.verifier import verify_task

from tests.helpers.federation import watch_assignments
from tests.helpers.malicious_aggregator import MaliciousAggregator, Tamper
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

SUBMIT = "/fedclinic.v1.AgentService/SubmitUpdate"


def _verify(fed, task_id: str, capsys, *extra: str) -> tuple[int, str]:
    """Run `fedclinic task verify` as a user would; (exit code, what it printed)."""
    c = fed.creds("scientist")
    capsys.readouterr()
    code = fedclinic_main(["task", "verify", task_id, "--address", fed.address, "--cert", c["cert"], "--key",
                           c["key"], "--ca", c["ca"], *extra])
    return code, capsys.readouterr().out


def _site_verdict(fed, site: str, task_id: str):
    """verify_task as ``site`` runs it, with its agent certificate (AgentService.GetTaskRecords)."""
    c = fed.creds(site)
    with SiteRecords(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost") as records:
        return verify_task(records, task_id, c["ca"], recompute=False)


def _publishing(fed, *sites: str) -> None:
    """Let ``sites`` (default all) take part in tasks that publish their updates (site policy)."""
    for site in sites or list(fed.sites):
        fed.sites[site].policy = {"publish_updates_allowed": True}


def _run(fed, task) -> str:
    with fed.client() as client:
        st = client.submit(task, package=tiny_package("logreg"))
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    return st.task_id


def test_an_honest_plain_task_with_published_updates_verifies(federation_factory, capsys):
    """An honest task that publishes its updates verifies (as its owner and as a site); a task of the same
    federation that does not publish them says which rounds it could not recompute, and keeps its updates out of
    the owner's reach (one federation for both)."""
    fed = federation_factory(2, start=False)
    fed.make_pki()
    _publishing(fed)
    fed.start_aggregator()
    for site in fed.sites:
        fed.start_agent(site)
    task_id = _run(fed, make_task(num_rounds=2, min_sites=2, verification={"publish_updates": True}))
    code, out = _verify(fed, task_id, capsys)
    assert code == 0, out
    assert out.count("recomputed: matches") == 2 and "verdict: OK" in out
    code, out = _verify(fed, task_id, capsys, "--json")
    doc = json.loads(out)
    assert doc["ok"] and [r["sites"] for r in doc["rounds"]] == [["site-a", "site-b"]] * 2
    site_view = _site_verdict(fed, "site-b", task_id)
    assert site_view.ok, site_view.text()
    assert [r.aggregate for r in site_view.rounds] == ["not recomputed: read by a site (statements, models given "
                                                        "and chain checked)"] * 2

    # a task that does not publish its updates
    task_id = _run(fed, make_task(num_rounds=1, min_sites=2))
    code, out = _verify(fed, task_id, capsys)
    assert code == 0, out
    assert ("note: round 1: not recomputed: the task does not publish its updates ([verification] publish_updates "
            "= false)") in out
    with fed.client() as client:  # and the updates stay out of the owner's reach
        records = client.task_records(task_id)
        sha = json.loads(records.rounds[0].statements[0].payload)["tensors"][0]["sha256"]
        with pytest.raises(Exception, match="publishes no blob"):
            client.fetch_task_blob(task_id, sha)


def test_an_honest_secure_aggregation_task_verifies_from_its_unmasked_sum(federation_factory, capsys):
    fed = federation_factory(3, start=False)
    fed.make_pki()
    fed.start_aggregator()
    for site in fed.sites:
        fed.start_agent(site)
    task_id = _run(fed, make_task(num_rounds=2, min_sites=3, local_epochs=1, seed=1,
                                  secure_aggregation={"enabled": True, "clip": 0.5, "bits": 20}))
    code, out = _verify(fed, task_id, capsys, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"], out
    assert [r["aggregate"] for r in doc["rounds"]] == ["recomputed: matches"] * 2
    assert [r["sites"] for r in doc["rounds"]] == [["site-a", "site-b", "site-c"]] * 2


def test_a_site_whose_policy_does_not_allow_published_updates_declines_such_a_task(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    _publishing(fed, "site-a")
    fed.start_aggregator()
    for site in fed.sites:
        fed.start_agent(site)
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=600,
                                     verification={"publish_updates": True}), package=tiny_package("logreg"))
        declined = next(e.message for e in client.watch(st.task_id) if e.kind == "declined")
        client.cancel(st.task_id)
    assert declined.startswith("site-b declined round 1: the task publishes each site's update to its owner "
                               "([verification] publish_updates = true), which this site's policy does not allow"), \
        declined


class _SplitView(Tamper):
    """Round 2: site-b is told to train from the task's initial model instead of round 1's result, and its upload
    is relabelled to the round's model (an aggregator that skips its own checks, see the test)."""

    def __init__(self) -> None:
        self.initial: tensors_pb2.ModelManifest | None = None  # set once the task exists
        self.round_base = ""
        self.lock = threading.Lock()

    def work_item(self, caller, item):
        if (caller == "agent site-b" and item.WhichOneof("item") == "assignment" and item.assignment.round == 2
                and self.initial):
            forged = agent_pb2.WorkItem()
            forged.CopyFrom(item)
            with self.lock:
                self.round_base = item.assignment.model.model_hash
            forged.assignment.model.CopyFrom(self.initial)
            del forged.assignment.downlink_deltas[:]
            return [forged]
        return [item]

    def request(self, caller, method, request):
        if (method == SUBMIT and caller == "agent site-b" and request.WhichOneof("item") == "header"
                and request.header.round == 2 and self.round_base):
            request.header.base_model_hash = self.round_base
        return request


def test_verify_names_a_split_view_where_one_site_got_another_model(federation_factory, capsys, monkeypatch):
    from aggregator_service.update_admission import UpdateAdmission

    fed = federation_factory(2, start=False)
    fed.make_pki()
    _publishing(fed)
    tamper = _SplitView()
    # the operator runs an aggregator that does not check the statements it relays (else site-b's would be refused:
    # it names the model site-b really trained from, not the one its header was relabelled to)
    monkeypatch.setattr(UpdateAdmission, "check_statement", lambda self, site, h: None)
    with MaliciousAggregator(fed, tamper) as evil:
        for site in fed.sites:
            fed.start_agent(site)
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=2, min_sites=2, verification={"publish_updates": True}),
                               package=tiny_package("logreg"))
            initial = evil.store.task(st.task_id).initial_model
            tamper.initial = manifest_to_proto(evil.store.model(initial))
            final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        rounds = evil.store.rounds_of(st.task_id)
        code, out = _verify(fed, st.task_id, capsys)
        capsys.readouterr()
        site_code = agent_main(["verify", st.task_id, "--config", str(fed.agent_config_path("site-a"))])
        site_out = capsys.readouterr().out
    assert code == 1, out
    got = {rounds[1].base_model[:12]: "site-a", initial[:12]: "site-b"}
    assert ("FAILED: round 2: split view: the sites were given different models ("
            + "; ".join(f"{site} trained from {h}" for h, site in sorted(got.items())) + ")") in out
    assert "verdict: FAILED" in out
    assert site_code == 1 and ("FAILED: round 2: split view: the sites were given different models ("  # a site sees
            + "; ".join(f"{site} trained from {h}" for h, site in sorted(got.items())) + ")") in site_out  # it too


def _forge_final_model(evil, task_id: str) -> str:
    """What an operator can do to a completed task: publish another model as its last round's result (every hash
    consistent, so downloads verify), in the store and the blob store."""
    last = evil.store.rounds_of(task_id)[-1]
    manifest = evil.store.model(last.model_hash)
    entries = []
    for t in manifest.tensors:
        if t.dtype == "float32" and t.name.endswith("weight"):
            arr = np.array(evil.blobs.array(t.sha256, t.dtype, t.shape)) + np.float32(0.25)
            entries.append(TensorEntry(t.name, t.dtype, t.shape, evil.blobs.put(raw_bytes(arr)), t.nbytes))
        else:
            entries.append(t)
    forged = Manifest(tuple(entries), manifest.files)
    with evil.store.transaction() as tx:
        forged_hash = tx.put_model(forged)
    evil.store.execute("UPDATE rounds SET model_hash=? WHERE task_id=? AND round=?", (forged_hash, task_id, last.round))
    evil.store.execute("UPDATE tasks SET final_model=? WHERE task_id=?", (forged_hash, task_id))
    return forged_hash


def test_verify_names_a_forged_global_model_that_is_not_the_aggregate(federation_factory, capsys, monkeypatch):
    import aggregator_service.task_records

    monkeypatch.setattr(aggregator_service.task_records, "ANSWER_BYTES", 1)  # one round per answer: the client pages
    fed = federation_factory(2, start=False)
    fed.make_pki()
    _publishing(fed)
    with MaliciousAggregator(fed, Tamper()) as evil:
        for site in fed.sites:
            fed.start_agent(site)
        task_id = _run(fed, make_task(num_rounds=2, min_sites=2, verification={"publish_updates": True}))
        code, out = _verify(fed, task_id, capsys)
        assert code == 0 and out.count("recomputed: matches") == 2, out  # honest so far
        forged = _forge_final_model(evil, task_id)
        with fed.client() as client:
            assert client.fetch_model(task_id, 0)[1] == forged  # what the scientist downloads verifies by its hash
        code, out = _verify(fed, task_id, capsys)
    assert code == 1, out
    assert (f"FAILED: round 2: the published model {forged[:12]} is not the fedavg aggregate of the committed "
            "updates: 'token_weights.weight' (off by up to 0.25)") in out
    assert "round 1" not in out.split("FAILED", 1)[1]


def _update(a: agent_pb2.Assignment, key: str) -> tuple[agent_pb2.UpdateHeader, bytes]:
    """A zero delta of the bias for assignment ``a`` (header, payload), not yet signed."""
    delta = np.zeros(2, dtype=np.float32)
    h = agent_pb2.UpdateHeader(task_id=a.task_id, round=a.round, attempt=a.attempt, idempotency_key=key,
                               base_model_hash=a.model.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=8)
    h.tensors.append(tensors_pb2.TensorHeader(name="bias", dtype="float32", shape=[2], codec="raw",
                                              sha256=tensor_sha256(delta), encoded_nbytes=delta.nbytes))
    return h, bytes(raw_bytes(delta))


def _send(stub, h: agent_pb2.UpdateHeader, payload: bytes):
    return stub.SubmitUpdate(iter([
        agent_pb2.UpdateChunk(header=h),
        agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(name="bias", header=h.tensors[0], offset=0, data=payload)),
        agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=len(payload)))]), timeout=60)


def test_a_statement_of_another_site_or_with_a_wrong_digest_is_refused_at_upload(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    c = fed.creds("site-a")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    signer = {s: Signer(key_path=fed.creds(s)["key"], cert_path=fed.creds(s)["cert"]) for s in ("site-a", "site-b")}
    try:
        stub.Hello(agent_pb2.HelloRequest(protocol_version=1, agent_version="test",
                                          capabilities=agent_pb2.Capabilities(features=["round-statements-v1"])))
        work, watch = watch_assignments(stub)
        fed.start_agent("site-b")
        with fed.client() as client:
            client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=600), package=tiny_package("logreg"))
            a = work.get(timeout=60)

        def refusal(h, payload) -> str:
            with pytest.raises(grpc.RpcError) as refused:
                _send(stub, h, payload)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return refused.value.details()

        other, payload = _update(a, "k1")  # signed with site-b's key and certificate, sent by site-a
        sign_header(other, "site-b", signer["site-b"])
        assert ("update rejected: its round statement is not valid: the round statement does not match the update "
                "it came with (it differs in site)") in refusal(other, payload)
        posing, payload = _update(a, "k2")  # site-b's signature over a statement naming site-a
        sign_header(posing, "site-a", signer["site-b"])
        assert ("its round statement is not valid: the round-statement statement is signed by the agent 'site-b', "
                "not by 'site-a'") in refusal(posing, payload)
        wrong, payload = _update(a, "k3")  # site-a's own signature, over another update than the one sent
        sign_header(wrong, "site-a", signer["site-a"])
        wrong.tensors[0].sha256, wrong.tensors[0].encoded_nbytes = tensor_sha256(np.ones(2, np.float32)), 8
        payload = bytes(raw_bytes(np.ones(2, np.float32)))
        assert "does not match the update it came with (it differs in tensors, update_digest)" in refusal(wrong,
                                                                                                          payload)
        unsigned, payload = _update(a, "k4")  # this site announced that it signs: an unsigned update is refused
        assert "it carries no signed round statement" in refusal(unsigned, payload)
        fine, payload = _update(a, "k5")
        sign_header(fine, "site-a", signer["site-a"])
        assert _send(stub, fine, payload).update_id
        watch.cancel()
    finally:
        channel.close()
