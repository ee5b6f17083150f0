"""The agent's gate chain runs the one task-spec validator (fedclinic.spec.validation) before anything else."""

from __future__ import annotations

import pytest

from fedclinic.proto import agent_pb2
from fedclinic.spec.task import Task
from fedclinic.transport.wire import manifest_to_proto
from hospital_agent.gates import DECLINE, GO, SpecGate
from tests.helpers.text_models import LABELS, tiny_package


@pytest.fixture(scope="module")
def assignment() -> agent_pb2.Assignment:
    package = tiny_package()
    task = Task(name="gate", dataset="notes", labels=LABELS, architecture="logreg", num_rounds=2, min_sites=1,
                local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16)
    return agent_pb2.Assignment(task_id="t1", round=1, spec=task.to_spec(),
                                model=manifest_to_proto(package.manifest()))


def test_a_valid_spec_proceeds(assignment):
    assert SpecGate().check(assignment) == GO


@pytest.mark.parametrize("tamper, expected", [
    (lambda a: setattr(a.spec.rounds, "num_rounds", 0), "num_rounds"),
    (lambda a: setattr(a.spec.update, "codec", "zip9"), "zip9"),
    (lambda a: a.spec.update.trainable_patterns.append("nosuchtensor"), "nosuchtensor"),
    (lambda a: setattr(a.spec.privacy, "level", "everything"), "level"),
])
def test_a_spec_the_validator_refuses_is_declined_for_good_with_its_reason(assignment, tamper, expected):
    bad = agent_pb2.Assignment()
    bad.CopyFrom(assignment)
    tamper(bad)
    verdict = SpecGate().check(bad)
    assert verdict.action == DECLINE and verdict.permanent and verdict.refused == "spec"
    assert "task spec rejected at this site" in verdict.reason and expected in verdict.reason
    assert "resubmit" in verdict.reason


def test_a_damaged_manifest_is_declined_not_raised(assignment):
    bad = agent_pb2.Assignment()
    bad.CopyFrom(assignment)
    bad.model.model_hash = "0" * 64  # no longer the hash of its content
    verdict = SpecGate().check(bad)
    assert verdict.action == DECLINE and "manifest" in verdict.reason
