"""Signed tasks (issue 17): an aggregator cannot make a site train a task its owner did not sign as it is.

The aggregator is the real one with a Tamper in the middle (tests/helpers/malicious_aggregator.py); the agents are
real processes. Each forgery is declined by the agent before it downloads anything, with a reason the task owner
reads in the task's status; nothing is trained. The honest task beside them completes.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from fedclinic.cli import _print_status as print_status
from fedclinic.client import state_name, submission_stream
from fedclinic.federation.local_federation import wait_until
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import control_pb2, task_pb2
from fedclinic.spec.signed_task import sign_task
from fedclinic.transport.wire import manifest_to_proto

from tests.helpers.malicious_aggregator import AGENT_FETCH, MaliciousAggregator, Tamper
from tests.helpers.signed_tasks import altered_package, declines, issue_signer
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

#: what the site says (to the task owner) about each forgery, by the name of the task it is played on
EXPECTED = {
    "raised-lr": "the task spec is not the one its owner 'scientist' signed",
    "other-dataset": "the task spec is not the one its owner 'scientist' signed",
    "foreign-ca": "was not issued by the CA",
    "agent-cert": "the task is signed by the agent 'site-z'; only a task owner",
    "aggregator-cert": "the task is signed by the aggregator 'aggregator'; only a task owner",
    "swapped-model": "is not the one the owner 'scientist' signed",
    "invented": "the task arrived unsigned and site policy require_signed_tasks is on",
}


class Forger(Tamper):
    """Rewrites each assignment by the attack its task's name names (module docstring); records which tasks the
    agents fetch models of."""

    def __init__(self, signers) -> None:
        self.signers = signers
        self.fetched: set[str] = set()
        self.lock = threading.Lock()

    def work_item(self, caller, item):
        if item.WhichOneof("item") != "assignment":
            return [item]
        a = item.assignment
        attack = a.spec.name
        if attack == "raised-lr":
            a.spec.training.learning_rate = 0.9
        elif attack == "other-dataset":
            a.spec.dataset = "icu-notes"
        elif attack in ("foreign-ca", "agent-cert", "aggregator-cert"):
            signed = json.loads(a.signed_task.payload)
            signer = self.signers[attack]
            forged = sign_task(signer, a.spec, model_hash=signed["model_hash"], owner=signed["owner"],
                               idempotency_key=signed["idempotency_key"])
            a.signed_task.CopyFrom(forged.to_proto())
        elif attack == "swapped-model":
            a.model.CopyFrom(manifest_to_proto(altered_package().manifest()))
        return [item]

    def request(self, caller, method, request):
        if method == AGENT_FETCH:
            with self.lock:
                self.fetched.add(request.task_id)
        return request


def test_forged_tasks_are_declined_before_any_download_and_the_honest_one_runs(federation_factory, tmp_path,
                                                                               capsys):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    signers = {
        "foreign-ca": issue_signer(tmp_path / "foreign-ca", tmp_path / "foreign", role="scientist", name="scientist"),
        "agent-cert": issue_signer(fed.ca_dir, tmp_path / "site-z", role="agent", name="site-z"),
        "aggregator-cert": issue_signer(fed.ca_dir, tmp_path / "agg2", role="aggregator", name="aggregator"),
    }
    forger = Forger(signers)
    with MaliciousAggregator(fed, forger) as evil:
        fed.start_agent("site-a")
        with fed.client() as client:
            package = tiny_package()
            tasks = {name: client.submit(make_task(name=name, num_rounds=1, min_sites=1, round_timeout_s=600),
                                         package=package).task_id
                     for name in [*EXPECTED, "honest"] if name != "invented"}
            # a task nobody submitted: the aggregator writes it into its own store, unsigned
            spec = client.status(tasks["honest"]).spec
            spec.name = "invented"
            tasks["invented"] = evil.aggregator.engine.create_task("scientist", "made-up", spec, package.manifest())

            final = client.wait(tasks["honest"], timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            assert final.signed and not client.status(tasks["invented"]).signed  # what the owner sees
            print_status(client.status(tasks["invented"]), as_json=False)  # `fedclinic task status`
            assert "UNSIGNED" in capsys.readouterr().out
            for name, expected in EXPECTED.items():
                wait_until(lambda: declines(client, tasks[name]), 120, f"site-a to decline the {name} task")
                (reason,) = declines(client, tasks[name])
                assert reason.startswith("site-a: ") and expected in reason, (name, reason)
                assert "nothing was downloaded" in reason, reason
                assert not client.status(tasks[name]).rounds[0].reports  # nothing trained
        assert forger.fetched == {tasks["honest"]}  # no model was fetched for any forgery


class Replayer(Tamper):
    def __init__(self) -> None:
        self.fetched: list[str] = []

    def request(self, caller, method, request):
        if method == AGENT_FETCH:
            self.fetched.append(request.task_id)
        return request


def test_a_signed_task_replayed_under_a_new_task_id_is_declined_even_after_the_agent_restarts(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.sites["site-b"].policy = {"signed_task_max_age_days": 7}
    tamper = Replayer()
    with MaliciousAggregator(fed, tamper) as evil:
        fed.start_agent("site-a")
        with fed.client() as client:
            package = tiny_package()
            first = client.submit(make_task(name="once", num_rounds=1, min_sites=1, sites=["site-a"]),
                                  package=package)
            final = client.wait(first.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            fed.signal_agent("site-a")
            fed.start_agent("site-a")
            # the aggregator runs the same signed task again, under a new task id
            replay = evil.aggregator.engine.create_task("scientist", "replayed", final.spec, package.manifest(),
                                                        evil.store.signed_task(first.task_id))
            wait_until(lambda: declines(client, replay), 120, "site-a to decline the replay")
            (reason,) = declines(client, replay)
            assert f"already ran at this site as task {first.task_id}" in reason, reason
            assert f"replays it under the new task id {replay}" in reason, reason
            assert not client.status(replay).rounds[0].reports

            # a site that never saw it: an old signed task (the owner's, from last month) is not started there
            spec = task_pb2.TaskSpec()
            spec.CopyFrom(final.spec)
            spec.sites[:] = ["site-b"]
            scientist = fed.creds("scientist")
            old = sign_task(Signer(key_path=scientist["key"], cert_path=scientist["cert"]), spec,
                            model_hash=package.manifest().model_hash, idempotency_key="last-month", owner="scientist",
                            signed_unix_ms=int(time.time() * 1000) - 30 * 86_400_000)
            stale = evil.aggregator.engine.create_task("scientist", "last-month", spec, package.manifest(),
                                                       old.to_proto().SerializeToString())
            fed.start_agent("site-b")
            wait_until(lambda: declines(client, stale), 120, "site-b to decline the stale task")
            (reason,) = declines(client, stale)
            assert reason.startswith("site-b: ") and "signed 30.0 days ago" in reason, reason
            assert "signed_task_max_age_days = 7" in reason, reason
    assert replay not in tamper.fetched and stale not in tamper.fetched


#: site -> its policy and what it says about a task without protection (min_sites 1, no DP, no secagg)
POLICIES = {
    "site-a": ({"require_secure_aggregation": True}, "site policy require_secure_aggregation"),
    "site-b": ({"require_dp": True}, "site policy require_dp"),
    "site-c": ({"min_cohort": 3}, "site policy min_cohort = 3: the task's rounds may close with 1 site(s)"),
    "site-d": ({"max_epsilon": 4.0}, "site policy max_epsilon = 4: the task declares no target epsilon"),
    "site-e": ({"allowed_owners": ["dr-lee"]}, "site policy allowed_owners does not include the task's owner "
                                               "'scientist'"),
}


def test_each_site_declines_a_task_that_does_not_offer_the_protection_its_policy_requires(federation_factory,
                                                                                         tmp_path):
    fed = federation_factory(5, start=False)
    for site, (policy, _) in POLICIES.items():
        fed.sites[site].policy = policy
    fed.start()
    with fed.client() as client:
        st = client.submit(make_task(name="unprotected", num_rounds=1, min_sites=1, round_timeout_s=600),
                           package=tiny_package())
        wait_until(lambda: len(declines(client, st.task_id)) == len(POLICIES), 180, "every site to decline")
        got = dict(d.split(": ", 1) for d in declines(client, st.task_id))
        for site, (_, expected) in POLICIES.items():
            assert expected in got[site], (site, got[site])
        assert not client.status(st.task_id).rounds[0].reports

        # the aggregator refuses a submission whose signature does not match what it carries
        package = tiny_package()
        manifest = package.manifest()
        task = make_task(name="mismatch", num_rounds=1, min_sites=1)
        spec = task.to_spec()
        scientist = fed.creds("scientist")
        own = issue_signer(fed.ca_dir, tmp_path / "dr-lee", role="scientist", name="dr-lee")
        me = Signer(key_path=scientist["key"], cert_path=scientist["cert"])
        other_spec = make_task(name="mismatch", num_rounds=5, min_sites=1).to_spec()
        cases = [
            (sign_task(me, other_spec, model_hash=manifest.model_hash, idempotency_key="k1", owner="scientist"),
             "k1", "the task spec is not the one its owner 'scientist' signed"),
            (sign_task(me, spec, model_hash=altered_package().manifest().model_hash, idempotency_key="k2",
                       owner="scientist"), "k2", "swapped after signing"),
            (sign_task(own, spec, model_hash=manifest.model_hash, idempotency_key="k3", owner="dr-lee"),
             "k3", "signed by the scientist 'dr-lee', not by the submitting scientist 'scientist'"),
            (sign_task(me, spec, model_hash=manifest.model_hash, idempotency_key="other", owner="scientist"),
             "k4", "covers another idempotency key"),
        ]
        for statement, key, expected in cases:
            header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key=key, model=manifest_to_proto(manifest),
                                                  signed_task=statement.to_proto())
            with pytest.raises(grpc.RpcError) as exc:
                client._conn.submit_raw(submission_stream(header, package, manifest), timeout=120)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
            assert expected in exc.value.details(), exc.value.details()
