"""The site's approval store (hospital_agent.approvals), the [policy] approval setting, and the aggregator
store's post-commit event hook that feeds its audit trail."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedclinic.errors import ConfigError
from fedclinic.proto import agent_pb2, task_pb2, tensors_pb2
from hospital_agent.approvals import ApprovalError, ApprovalStore


def _assignment(task_id: str = "t-1", *, lr: float = 0.05, send=("bias",), rnd: int = 1) -> agent_pb2.Assignment:
    spec = task_pb2.TaskSpec(name="n", family="text-classification", dataset="notes",
                             training=task_pb2.TrainingConfig(learning_rate=lr))
    model = tensors_pb2.ModelManifest(model_hash="m" * 64, tensors=[
        tensors_pb2.TensorHeader(name="bias", dtype="float32", shape=[2], sha256="a" * 64, encoded_nbytes=8),
        tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[3, 2], sha256="b" * 64, encoded_nbytes=24)])
    return agent_pb2.Assignment(task_id=task_id, round=rnd, spec=spec, model=model, send_tensors=list(send))


def test_manual_approval_lifecycle(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path / "approvals.sqlite")
    rec, what = store.observe(_assignment(), auto=False)
    assert (rec.state, what) == ("pending", "new")
    assert rec.send_tensors == [["bias", "float32", [2], 8]]
    assert store.observe(_assignment(rnd=2), auto=False)[1] == ""
    # a second process (the CLI) decides; the agent's connection sees it
    other = ApprovalStore(tmp_path / "approvals.sqlite")
    assert other.decide("t-1", approve=True, by="site-admin:it").state == "approved"
    assert store.states(["t-1", "t-2"]) == {"t-1": "approved"}
    with pytest.raises(ApprovalError, match="already approved"):
        other.decide("t-1", approve=True, by="x")
    # the same task id with another spec, or other tensors, needs a new review
    rec, what = store.observe(_assignment(lr=0.5, rnd=3), auto=False)
    assert (rec.state, what) == ("pending", "changed") and "review it again" in rec.note
    other.decide("t-1", approve=True, by="x")
    assert store.observe(_assignment(lr=0.5, send=("bias", "w")), auto=False)[0].state == "pending"
    with pytest.raises(ApprovalError, match="needs a reason"):
        other.decide("t-1", approve=False, by="x", reason="  ")
    rec = other.decide("t-1", approve=False, by="x", reason="ethics board said no")
    assert (rec.state, rec.reason) == ("rejected", "ethics board said no")
    with pytest.raises(ApprovalError, match="final"):
        other.decide("t-1", approve=True, by="x")
    # a rejection stays, whatever the aggregator sends next
    assert store.observe(_assignment(lr=9.0), auto=False)[0].state == "rejected"
    with pytest.raises(ApprovalError, match="tasks list"):
        other.decide("t-unknown", approve=True, by="x")


def test_auto_approval_records_the_task_as_approved(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path / "approvals.sqlite")
    rec, what = store.observe(_assignment(), auto=True, decided_by="policy")
    assert (rec.state, rec.decided_by, what) == ("approved", "policy", "new")
    assert [r.task_id for r in store.all()] == ["t-1"]


def test_policy_approval_setting(tmp_path: Path) -> None:
    from hospital_agent.config import AgentConfig

    doc = {"aggregator": "a:1", "work_dir": "w", "tls": {"cert": "c", "key": "k", "ca": "ca"}}
    assert AgentConfig.from_dict(doc, base=tmp_path, source="t").policy.approval == "auto"
    doc["policy"] = {"approval": "manual"}
    assert AgentConfig.from_dict(doc, base=tmp_path, source="t").policy.approval == "manual"
    doc["policy"] = {"approval": "sometimes"}
    with pytest.raises(ConfigError, match='approval must be "auto" or "manual"'):
        AgentConfig.from_dict(doc, base=tmp_path, source="t")


def test_store_hands_events_to_the_audit_hook_only_after_commit(tmp_path: Path) -> None:
    from aggregator_service.store import SqliteStore

    store = SqliteStore(tmp_path)
    seen: list[list[dict]] = []
    store.on_commit = seen.append
    with pytest.raises(RuntimeError):
        with store.transaction() as tx:
            tx.add_event("t-1", "submitted", "rolled back", actor="x")
            raise RuntimeError("boom")
    assert seen == []
    with store.transaction() as tx:
        tx.add_event("t-1", "submitted", "kept", actor="scientist", model_hash="h")
        tx.add_event("t-1", "round-opened", "r1", round=1)
    assert seen == [[{"task_id": "t-1", "kind": "submitted", "message": "kept", "actor": "scientist",
                      "details": {"model_hash": "h"}},
                     {"task_id": "t-1", "kind": "round-opened", "message": "r1", "actor": "", "details": {"round": 1}}]]
    store.close()


def test_audit_trail_maps_events_and_verifies(tmp_path: Path) -> None:
    from aggregator_service.audit_trail import AuditTrail
    from fedclinic.runtime.audit_log import verify

    trail = AuditTrail(tmp_path / "audit.jsonl")
    trail.on_commit([{"task_id": "t-1", "kind": "update-received", "message": "m", "actor": "site-a",
                      "details": {"size": 8, "sha256": "f" * 64}},
                     {"task_id": "t-1", "kind": "secagg-aborted", "message": "m", "actor": "", "details": {}}])
    trail.record("auth.refused", actor="site-a", method="/x", reason="r")
    trail.close()
    report = verify(tmp_path / "audit.jsonl")
    assert report.ok and report.records == 3
    import json

    rows = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["actor"]) for r in rows] == [("update.received", "site-a"),
                                                      ("task.secagg_aborted", "aggregator"),
                                                      ("auth.refused", "site-a")]
    assert rows[0]["details"] == {"message": "m", "size": 8, "sha256": "f" * 64}
