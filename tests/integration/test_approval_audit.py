"""Task approval at the site (issue #7 item 4) and the audit trails of both services (item 5), over real
processes: the approval CLI is a separate process that shares the agent's work_dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fedclinic.client import held_sites, state_name, waiting_sites
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import control_pb2, control_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.spec.task import Task
from hospital_agent.gates import HOLD_AWAITING_APPROVAL

from tests.helpers.text_models import LABELS, tiny_package

pytestmark = pytest.mark.integration


def _task(**kw) -> Task:
    base = dict(name="approval-it", dataset="notes", labels=LABELS, architecture="logreg", num_rounds=2,
                min_sites=1, local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16,
                round_timeout_s=120, on_quorum_miss="fail")
    base.update(kw)
    return Task(**base)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def _owner_cli(fed, *args: str) -> subprocess.CompletedProcess:
    """`fedclinic ARGS` as the task's owner (the scientist certificate, settings from the environment)."""
    c = fed.creds("scientist")
    env = {**os.environ, "FEDCLINIC_ADDRESS": fed.address, "FEDCLINIC_CERT": c["cert"], "FEDCLINIC_KEY": c["key"],
           "FEDCLINIC_CA": c["ca"]}
    return subprocess.run([sys.executable, "-m", "fedclinic.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _tasks(fed, site: str, *args: str) -> subprocess.CompletedProcess:
    return _cli("-m", "hospital_agent.cli", "tasks", *args, "--config", str(fed.agent_config_path(site)))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _verify(path: Path) -> subprocess.CompletedProcess:
    return _cli("-m", "fedclinic.cli", "audit", "verify", str(path))


def _state(work_dir: Path, task_id: str) -> str | None:
    from hospital_agent.approvals import ApprovalStore

    store = ApprovalStore(work_dir / "approvals.sqlite")
    try:
        rec = store.get(task_id)
        return rec.state if rec else None
    finally:
        store.close()


def _cached_files(work_dir: Path) -> list[Path]:
    return [p for p in (work_dir / "cache").rglob("*") if p.is_file()]


def test_manual_approval_holds_the_task_until_approved_and_a_rejection_reaches_the_owner(federation_factory):
    fed = federation_factory(1, start=False)
    fed.sites["site-a"].policy = {"approval": "manual"}
    fed.start()
    work = fed.root / "agent-site-a"
    package = tiny_package("logreg")
    with fed.client() as client:
        held = client.submit(_task(), package=package)
        wait_until(lambda: _state(work, held.task_id) == "pending", 60, "the agent to hold the task for approval",
                   check=lambda: fed.agents["site-a"].poll() is None or pytest.fail(fed.log_text("agent-site-a")))
        wait_until(lambda: "task awaiting approval" in fed.log_text("agent-site-a"), 30, "the agent's hold message")

        show = _tasks(fed, "site-a", "show", held.task_id)
        assert show.returncode == 0, show.stderr
        for name in package.tensors:  # every tensor an update would carry, by name
            assert name in show.stdout
        assert "what would leave this site, once per round (2 round(s))" in show.stdout
        assert "codec 'raw'" in show.stdout and "differential privacy: none" in show.stdout
        assert "secure aggregation: off" in show.stdout and '"name": "approval-it"' in show.stdout
        listed = _tasks(fed, "site-a", "list")
        assert listed.returncode == 0 and held.task_id in listed.stdout and "pending" in listed.stdout

        # held back: the round waits, nothing was fetched, nothing trained
        status = client.status(held.task_id)
        assert state_name(status.state) == "running"
        assert status.rounds[0].downlink_bytes == 0 and not status.rounds[0].reports
        assert _cached_files(work) == []
        # the task's owner sees which site the round waits for, and that the site holds it for approval
        assert waiting_sites(status) == ["site-a"]
        wait_until(lambda: held_sites(client.status(held.task_id)) == {"site-a": HOLD_AWAITING_APPROVAL}, 30,
                   "the site's hold to reach the task owner")
        shown = _owner_cli(fed, "task", "status", held.task_id)
        assert shown.returncode == 0, shown.stderr
        assert f"held by site-a: {HOLD_AWAITING_APPROVAL}" in shown.stdout and "waiting for" not in shown.stdout

        approve = _tasks(fed, "site-a", "approve", held.task_id)
        assert approve.returncode == 0, approve.stderr
        final = client.wait(held.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert [len(r.reports) for r in final.rounds] == [1, 1] and final.rounds[0].downlink_bytes > 0
        assert waiting_sites(final) == [] and held_sites(final) == {}
        assert "waiting for" not in _owner_cli(fed, "task", "status", held.task_id).stdout
        # the aggregator's trail: held, then released on approval, before the site's update arrived
        agg = [r for r in _records(fed.root / "aggregator-state" / "audit.jsonl") if r["task_id"] == held.task_id]
        kinds = [r["kind"] for r in agg]
        holds = [r["details"]["reason"] for r in agg if r["kind"] == "site.held"]
        assert holds == [HOLD_AWAITING_APPROVAL, ""], holds
        assert max(i for i, k in enumerate(kinds) if k == "site.held") < kinds.index("update.received"), kinds

        # a second task, rejected: declined for good, the reason reaches its owner, nothing is fetched
        rejected = client.submit(_task(name="rejected-it"), package=tiny_package("logreg", seed=1))
        wait_until(lambda: _state(work, rejected.task_id) == "pending", 60, "the second task to be held")
        reject = _tasks(fed, "site-a", "reject", rejected.task_id, "--reason", "not reviewed by the ethics board")
        assert reject.returncode == 0, reject.stderr

        def declined() -> list[str]:
            return list(client.status(rejected.task_id).rounds[0].declined)

        wait_until(lambda: declined(), 30, "the rejection to reach the task owner")
        assert declined() == ["site-a: rejected at site-a: not reviewed by the ethics board"]
        assert client.status(rejected.task_id).rounds[0].downlink_bytes == 0
        again = _tasks(fed, "site-a", "approve", rejected.task_id)
        assert again.returncode == 2 and "final" in again.stderr
        unknown = _tasks(fed, "site-a", "approve", "t-000000000000")
        assert unknown.returncode == 2 and "tasks list" in unknown.stderr
        client.cancel(rejected.task_id, "rejected by the only site")

    listed = _tasks(fed, "site-a", "list").stdout
    assert "approved" in listed and "rejected" in listed and "not reviewed by the ethics board" in listed
    # the site's audit trail: a chain that verifies, with the decisions in order
    trail = work / "audit.jsonl"
    assert _verify(trail).returncode == 0
    records = _records(trail)
    kinds_a = [r["kind"] for r in records if r["task_id"] == held.task_id]
    assert kinds_a[:4] == ["task.awaiting_approval", "task.approved", "model.fetched", "update.sent"], kinds_a
    assert set(kinds_a[4:]) <= {"model.fetched", "update.sent"} and kinds_a.count("update.sent") == 2, kinds_a
    assert [r["kind"] for r in records if r["task_id"] == rejected.task_id] == ["task.awaiting_approval",
                                                                              "task.rejected"]
    approved = next(r for r in _records(trail) if r["kind"] == "task.approved")
    assert approved["details"]["mode"] == "manual" and approved["actor"].startswith("site-admin:")
    rejection = next(r for r in _records(trail) if r["kind"] == "task.rejected")
    assert rejection["details"]["reason"] == "not reviewed by the ethics board"


def test_audit_trails_of_both_services_verify_and_record_the_task(federation_factory, tmp_path):
    fed = federation_factory(2)
    with fed.client() as client:
        status = client.submit(_task(min_sites=2, num_rounds=1), package=tiny_package("logreg"))
        final = client.wait(status.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        client.fetch_package(status.task_id)
    # an agent's certificate calling the control service is refused, and the refusal is in the trail
    a = fed.creds("site-a")
    with secure_channel(fed.address, TlsFiles(a["cert"], a["key"], a["ca"]), server_name="localhost") as ch:
        with pytest.raises(grpc.RpcError) as exc:
            control_pb2_grpc.ControlStub(ch).ListTasks(control_pb2.ListTasksRequest(), timeout=15)
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED

    agg = fed.root / "aggregator-state" / "audit.jsonl"
    wait_until(lambda: any(r["kind"] == "auth.refused" for r in _records(agg)), 10, "the refusal's audit record")
    tid = status.task_id
    for path in (agg, fed.root / "agent-site-a" / "audit.jsonl", fed.root / "agent-site-b" / "audit.jsonl"):
        result = _verify(path)
        assert result.returncode == 0, result.stderr
        assert "OK" in result.stdout
    records = _records(agg)
    task_records = [r for r in records if r["task_id"] == tid]

    def at(kind: str, actor: str | None = None) -> int:
        return next(i for i, r in enumerate(task_records) if r["kind"] == kind and actor in (None, r["actor"]))

    assert [r["kind"] for r in task_records[:2]] == ["task.submitted", "round.opened"]
    for site in ("site-a", "site-b"):
        assert at("round.opened") < at("site.joined_round", site) < at("model.downloaded", site) \
            < at("update.received", site) < at("round.closed") < at("task.completed") \
            < at("model.downloaded", "scientist")
    closed = next(r for r in records if r["kind"] == "round.closed")
    assert closed["details"]["model_hash"] == final.final_model_hash
    downloads = [r for r in records if r["kind"] == "model.downloaded"]
    assert sorted(r["actor"] for r in downloads) == ["scientist", "site-a", "site-b"]
    assert all(r["details"]["complete"] and r["details"]["bytes"] > 0 for r in downloads)
    assert next(r for r in records if r["kind"] == "task.submitted")["actor"] == "scientist"
    refused = [r for r in records if r["kind"] == "auth.refused"]
    assert refused[-1]["actor"] == "site-a" and refused[-1]["details"]["method"].endswith("Control/ListTasks")
    assert {r["actor"] for r in records if r["kind"] == "site.connected"} == {"site-a", "site-b"}
    # each site's update.sent names the same size and sha256 as the aggregator's update.received
    received = {r["actor"]: r["details"] for r in records if r["kind"] == "update.received"}
    for site in ("site-a", "site-b"):
        site_records = _records(fed.root / f"agent-{site}" / "audit.jsonl")
        site_kinds = [r["kind"] for r in site_records if r["task_id"] == tid]
        assert site_kinds == ["task.approved", "model.fetched", "update.sent"]
        sent = next(r for r in site_records if r["kind"] == "update.sent")["details"]
        assert (sent["size"], sent["sha256"]) == (received[site]["size"], received[site]["sha256"])
        assert sent["update_id"] == received[site]["update_id"]
    # and a one-byte edit breaks the chain
    edited = tmp_path / "edited.jsonl"
    data = bytearray(agg.read_bytes())
    at = data.index(b'"site-a"') + 6
    data[at] = ord("b")
    edited.write_bytes(bytes(data))
    broken = _verify(edited)
    assert broken.returncode == 1 and "FAILED" in broken.stderr
