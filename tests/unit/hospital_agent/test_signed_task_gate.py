"""The site's check of the owner's signed task (hospital_agent.gates.SignedTaskGate, hospital_agent.task_bindings)
and the policy keys that require protection (hospital_agent.config.SitePolicy), with real certificates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedclinic import pki
from fedclinic.errors import ConfigError
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2
from fedclinic.spec.signed_task import sign_task
from fedclinic.spec.task import Task
from fedclinic.transport.wire import manifest_to_proto
from hospital_agent.config import AgentConfig
from hospital_agent.gates import DECLINE, GO, SignedTaskGate
from hospital_agent.task_bindings import TaskBindings
from tests.helpers.signed_tasks import altered_package
from tests.helpers.text_models import LABELS, tiny_package


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("signed-task-gate")
    pki.init_ca(root / "ca")
    pki.init_ca(root / "foreign-ca")
    signers = {}
    for ca, role, name in (("ca", "scientist", "alice"), ("ca", "admin", "root"), ("ca", "agent", "site-b"),
                           ("ca", "aggregator", "aggregator"), ("foreign-ca", "scientist", "alice"),
                           ("ca", "agent", "site-a")):
        c = pki.issue(root / ca, role=role, name=name, out_dir=root / f"{ca}-{name}")
        signers[f"{ca}/{name}"] = Signer(key_path=c.key_path, cert_path=c.cert_path)
    task = Task(name="gate", dataset="notes", labels=LABELS, architecture="logreg", num_rounds=2, min_sites=1,
                local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16)
    return {"root": root, "signers": signers, "spec": task.to_spec(), "manifest": tiny_package().manifest(),
            "other": altered_package().manifest()}


def _config(world, tmp_path: Path, **policy) -> AgentConfig:
    site = world["root"] / "ca-site-a"
    doc = {"aggregator": "127.0.0.1:1", "work_dir": str(tmp_path / "work"),
           "tls": {"cert": str(site / "site-a.crt"), "key": str(site / "site-a.key"), "ca": str(site / "ca.crt")},
           "datasets": {"notes": {"path": str(tmp_path / "notes.jsonl")}}, "policy": policy}
    return AgentConfig.from_dict(doc, base=tmp_path, source="agent.toml")


def _assignment(world, *, task_id="t-1", rnd=1, signer="ca/alice", key="key-1", owner=None,
                signed=True, signed_unix_ms=None) -> agent_pb2.Assignment:
    a = agent_pb2.Assignment(task_id=task_id, round=rnd, attempt=1, spec=world["spec"],
                             model=manifest_to_proto(world["manifest"]))
    if signed:
        s = world["signers"][signer]
        statement = sign_task(s, world["spec"], model_hash=world["manifest"].model_hash, idempotency_key=key,
                              owner=owner or signer.split("/")[1], signed_unix_ms=signed_unix_ms)
        a.signed_task.CopyFrom(statement.to_proto())
    return a


def _gate(world, tmp_path, **policy) -> SignedTaskGate:
    cfg = _config(world, tmp_path, **policy)
    return SignedTaskGate(cfg, TaskBindings(cfg.work_dir / "task-bindings.sqlite"))


def _declined(verdict, *expected: str) -> None:
    assert verdict.action == DECLINE and verdict.permanent, verdict
    for text in expected:
        assert text in verdict.reason, verdict.reason


def test_the_task_as_signed_proceeds_and_an_admin_may_sign(world, tmp_path):
    gate = _gate(world, tmp_path)
    a = _assignment(world)
    assert gate.check(a) == GO
    assert gate.check(a) == GO  # the same assignment again (the aggregator resends it)
    a2 = agent_pb2.Assignment()
    a2.CopyFrom(a)
    a2.round = 2
    a2.model.CopyFrom(manifest_to_proto(world["other"]))  # a later round starts from the aggregate
    assert gate.check(a2) == GO
    assert gate.check(_assignment(world, task_id="t-2", signer="ca/root", key="k2")) == GO


@pytest.mark.parametrize("alter, expected", [
    (lambda a, w: setattr(a.spec.training, "learning_rate", 5.0), "not the one its owner 'alice' signed"),
    (lambda a, w: setattr(a.spec, "dataset", "icu-notes"), "altered after signing"),
    (lambda a, w: a.spec.sites.append("site-z"), "altered after signing"),
    (lambda a, w: a.model.CopyFrom(manifest_to_proto(w["other"])), "swapped after signing"),
    (lambda a, w: setattr(a, "round", 3), "outside the 2 round(s)"),
    (lambda a, w: setattr(a.signed_task, "purpose", "model"), "not for a task"),
    (lambda a, w: setattr(a.signed_task, "payload", a.signed_task.payload.replace(b"key-1", b"key-2")),
     "changed after the scientist 'alice' signed it"),
])
def test_an_altered_task_is_declined_before_download(world, tmp_path, alter, expected):
    a = _assignment(world)
    alter(a, world)
    _declined(_gate(world, tmp_path).check(a), expected, "nothing was downloaded")


@pytest.mark.parametrize("signer, owner, expected", [
    ("foreign-ca/alice", None, "was not issued by the CA"),
    ("ca/site-b", None, "signed by the agent 'site-b'; only a task owner"),
    ("ca/aggregator", None, "signed by the aggregator 'aggregator'"),
    ("ca/site-b", "alice", "signed by the agent 'site-b'"),
    ("ca/alice", "bob", "names owner 'bob' but is signed by 'alice'"),
])
def test_a_task_nobody_entitled_signed_is_declined(world, tmp_path, signer, owner, expected):
    _declined(_gate(world, tmp_path).check(_assignment(world, signer=signer, owner=owner)), expected)


def test_unsigned_tasks_run_only_where_the_policy_allows_them(world, tmp_path):
    a = _assignment(world, signed=False)
    _declined(_gate(world, tmp_path / "1").check(a), "arrived unsigned", "require_signed_tasks")
    assert _gate(world, tmp_path / "2", require_signed_tasks=False).check(a) == GO
    _declined(_gate(world, tmp_path / "3", require_signed_tasks=False, allowed_owners=["alice"]).check(a),
              "allowed_owners")


def test_allowed_owners(world, tmp_path):
    gate = _gate(world, tmp_path, allowed_owners=["bob"])
    verdict = gate.check(_assignment(world))
    _declined(verdict, "allowed_owners does not include the task's owner 'alice'", "'bob'")
    assert verdict.refused == "policy"
    assert _gate(world, tmp_path / "2", allowed_owners=["alice"]).check(_assignment(world)) == GO


def test_a_replay_under_another_task_id_is_declined_across_restarts(world, tmp_path):
    a = _assignment(world, task_id="t-1")
    assert _gate(world, tmp_path).check(a) == GO
    replay = agent_pb2.Assignment()
    replay.CopyFrom(a)
    replay.task_id = "t-evil"
    gate = _gate(world, tmp_path)  # a new process: the bindings are on disk
    _declined(gate.check(replay), "already ran at this site as task t-1", "replays it under the new task id t-evil")
    # another statement the owner signed (another submission), presented under the known task id
    other = _assignment(world, task_id="t-1", key="key-2")
    _declined(gate.check(other), "task t-1 came to this site before with another signed task")
    assert gate.check(a) == GO


def test_a_task_signed_too_long_ago_is_not_started_but_one_running_here_goes_on(world, tmp_path):
    import time

    ten_days_ago = int(time.time() * 1000) - 10 * 86_400_000
    old = _assignment(world, key="old", signed_unix_ms=ten_days_ago)
    assert _gate(world, tmp_path / "a").check(old) == GO  # no limit by default
    _declined(_gate(world, tmp_path / "b", signed_task_max_age_days=7).check(old), "signed 10.0 days ago",
              "signed_task_max_age_days = 7")
    assert _gate(world, tmp_path / "c", signed_task_max_age_days=11).check(old) == GO
    # accepted here before the limit was set (or while young): it goes on
    assert _gate(world, tmp_path / "a", signed_task_max_age_days=7).check(old) == GO


def _spec(**kw):
    """A spec (min_sites 3, no protection) with ``kw`` set on its proto: privacy level, target_epsilon,
    noise_multiplier, secure_aggregation (enabled), min_cohort (secure aggregation's), min_sites."""
    spec = Task(name="p", dataset="notes", labels=LABELS, architecture="logreg", num_rounds=1, min_sites=3,
                local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16).to_spec()
    spec.privacy.level = kw.get("privacy", "")
    spec.privacy.target_epsilon = kw.get("target_epsilon", 0.0)
    spec.privacy.noise_multiplier = kw.get("noise_multiplier", 0.0)
    spec.secure_aggregation.enabled = kw.get("secure_aggregation", False)
    spec.secure_aggregation.min_cohort = kw.get("min_cohort", 0)
    spec.rounds.min_sites = kw.get("min_sites", 3)
    return spec


@pytest.mark.parametrize("policy, spec_kw, expected", [
    ({"require_secure_aggregation": True}, {}, "require_secure_aggregation"),
    ({"require_dp": True}, {}, "require_dp"),
    ({"require_dp": True}, {"privacy": "client"}, "require_dp"),
    ({"min_cohort": 4}, {}, "min_cohort = 4: the task's rounds may close with 3 site(s)"),
    ({"min_cohort": 5}, {"secure_aggregation": True, "min_cohort": 4}, "may close with 4 site(s)"),
    ({"max_epsilon": 4.0}, {}, "declares no target epsilon"),
    ({"max_epsilon": 4.0}, {"privacy": "sample", "target_epsilon": 8.0}, "target epsilon is 8"),
    ({"max_epsilon": 4.0}, {"privacy": "sample", "noise_multiplier": 1.0}, "declares no target epsilon"),
])
def test_a_task_without_the_protection_the_policy_requires_is_refused(world, tmp_path, policy, spec_kw, expected):
    cfg = _config(world, tmp_path, **policy)
    reason = cfg.policy.protection_refusal(_spec(**spec_kw))
    assert reason is not None and expected in reason and "site policy" in reason, reason


@pytest.mark.parametrize("policy, spec_kw", [
    ({"require_secure_aggregation": True}, {"secure_aggregation": True}),
    ({"require_dp": True, "max_epsilon": 8.0}, {"privacy": "sample", "target_epsilon": 8.0}),
    ({"min_cohort": 3}, {}),
    ({"min_cohort": 5}, {"secure_aggregation": True, "min_cohort": 5, "min_sites": 3}),
])
def test_a_task_with_the_protection_the_policy_requires_passes(world, tmp_path, policy, spec_kw):
    assert _config(world, tmp_path, **policy).policy.protection_refusal(_spec(**spec_kw)) is None


@pytest.mark.parametrize("policy, expected", [
    ({"require_signed_tasks": "yes"}, "require_signed_tasks must be true or false"),
    ({"require_dp": 1}, "require_dp must be true or false"),
    ({"allowed_owners": "alice"}, "allowed_owners must be a list"),
    ({"min_cohort": -1}, "min_cohort must be an integer >= 0"),
    ({"max_epsilon": 0}, "max_epsilon must be a number > 0"),
    ({"max_epsilon": True}, "max_epsilon must be a number > 0"),
    ({"signed_task_max_age_days": -1}, "signed_task_max_age_days must be a number > 0"),
    ({"allowed_owner": ["alice"]}, "allowed_owner"),
])
def test_bad_policy_values_are_refused_at_load(world, tmp_path, policy, expected):
    with pytest.raises(ConfigError, match=expected):
        _config(world, tmp_path, **policy)
