"""The Store interface (aggregator_service.store) against both implementations, SQLite on a real file and PostgreSQL
on the suite's real server (each test runs once per backend): each named read and write, typed records back, one
transaction per unit of work (events after commit, nothing after a rollback), uniqueness, and the state surviving
a reopen."""

from __future__ import annotations

import sqlite3

import numpy as np
import psycopg
import pytest

from aggregator_service.store import SCHEMA_VERSION, AssignmentRecord, EventRecord, RoundRecord, Store, TaskRecord, UpdateRecord
from fedclinic.transport.package import ModelPackage
from fedclinic.proto import control_pb2, task_pb2, tensors_pb2

S = control_pb2


def _spec(**kw) -> task_pb2.TaskSpec:
    return task_pb2.TaskSpec(name="n", family="text-classification", dataset="d", **kw)


def _update(store: Store, update_id: str, site: str, *, rnd: int = 1, key: str | None = None,
            received_ms: int = 10) -> UpdateRecord:
    return UpdateRecord(update_id, "t-1", rnd, site, key or site, 7, 16, str(store.state_dir / f"{update_id}.bin"),
                        "[]", {"loss": 0.5}, {"accuracy": 0.75}, received_ms, 32, 40)


#: what a second update of the same site and round (or key) raises, per backend
DUPLICATE = (sqlite3.IntegrityError, psycopg.IntegrityError)


@pytest.fixture()
def store(open_test_store):
    return open_test_store()


@pytest.fixture()
def running(store):
    """A task t-1 with round 1 open, sites s1 (assigned, attempt 1) and s2 (assigned, then declined)."""
    manifest = ModelPackage({"w": np.zeros(3, np.float32)}).manifest()
    with store.transaction() as tx:
        model = tx.put_model(manifest)
        tx.insert_task("t-1", "alice", "key-1", _spec(), S.TASK_STATE_QUEUED, 100, model)
        tx.open_round("t-1", 1, 1, 2, 110, 5000, model)
        tx.assign("t-1", 1, "s1", 1, 120)
        tx.assign("t-1", 1, "s2", 1, 121)
    return model


def test_each_store_implements_the_interface(store):
    assert isinstance(store, Store) and store.schema_version == SCHEMA_VERSION and store.state_dir.is_dir()


def test_tasks_and_rounds_come_back_as_typed_records(store, running):
    t = store.task("t-1")
    assert isinstance(t, TaskRecord) and t.spec == _spec()
    assert (t.owner, t.idempotency_key, t.state, t.current_round, t.initial_model) == (
        "alice", "key-1", S.TASK_STATE_RUNNING, 1, running)
    assert store.task("t-0") is None and store.task_by_key("alice", "key-1") == t
    assert store.task_by_key("bob", "key-1") is None
    assert store.tasks() == [t] and store.tasks(S.TASK_STATE_RUNNING) == [t] and store.tasks(S.TASK_STATE_FAILED) == []
    r = store.round("t-1", 1)
    assert isinstance(r, RoundRecord) and (r.attempt, r.state, r.sites_target, r.deadline_ms, r.base_model) == (
        1, S.ROUND_STATE_OPEN, 2, 5000, running)
    assert store.open_round_of("t-1") == r and store.rounds_of("t-1") == [r]
    assert store.open_rounds() == [r] and store.open_rounds(running_only=False) == [r]
    assert store.model(running).tensor("w").shape == (3,) and store.model("nope") is None
    with store.transaction() as tx:
        tx.reopen_round("t-1", 1, 9000)
    assert (store.round("t-1", 1).attempt, store.round("t-1", 1).deadline_ms) == (2, 9000)


def test_closing_rounds_and_ending_tasks(store, running):
    assert store.last_closed_round("t-1") is None and store.newest_round_model("t-1") == ""
    with store.transaction() as tx:
        tx.close_round("t-1", 1, 200, "m1", {"loss": 0.25}, {"m/w": ["ab" * 32, "float32", [3]]})
        tx.open_round("t-1", 2, 1, 2, 210, 6000, "m1")
    closed = store.last_closed_round("t-1")
    assert (closed.round, closed.state, closed.closed_ms, closed.model_hash) == (1, S.ROUND_STATE_CLOSED, 200, "m1")
    assert closed.metrics == {"loss": 0.25} and closed.strategy_state == {"m/w": ["ab" * 32, "float32", [3]]}
    assert store.newest_round_model("t-1") == "m1" and store.task("t-1").current_round == 2
    with store.transaction() as tx:
        tx.fail_round("t-1", 2, 300)
        tx.end_task("t-1", S.TASK_STATE_FAILED, "quorum missed", 301)
    t = store.task("t-1")
    assert (t.state, t.error, t.updated_ms) == (S.TASK_STATE_FAILED, "quorum missed", 301)
    assert store.round("t-1", 2).state == S.ROUND_STATE_FAILED and store.open_rounds(running_only=False) == []
    with store.transaction() as tx:
        tx.complete_task("t-1", "m1", 400)
    assert (store.task("t-1").state, store.task("t-1").final_model) == (S.TASK_STATE_COMPLETED, "m1")


def test_assignments_holds_and_declines(store, running):
    a = store.assignment("t-1", 1, "s1")
    assert isinstance(a, AssignmentRecord) and (a.attempt, a.assigned_ms, a.declined, a.held) == (1, 120, "", "")
    assert store.is_assigned("t-1", "s1") and not store.is_assigned("t-1", "s3")
    with store.transaction() as tx:
        tx.hold("t-1", 1, "s1", "awaiting approval")
        tx.decline("t-1", 1, "s2", "busy", permanent=False)
    assert store.assignment("t-1", 1, "s1").held == "awaiting approval"
    assert [x.site for x in store.assignments_of("t-1", 1)] == ["s1", "s2"]
    assert store.active_assignments("t-1", 1, 1) == 1 and store.outstanding_assignments("t-1", 1) == 1
    assert store.site_declines("t-1") == {} and not store.declined_for_good("t-1", "s2")
    with store.transaction() as tx:
        tx.decline("t-1", 1, "s2", "dataset not allowed", permanent=True)
    assert store.site_declines("t-1") == {"s2": "dataset not allowed"} and store.declined_for_good("t-1", "s2")
    assert store.active_assignments("t-1", 1, 2) == 0  # s1 belongs to attempt 1 and has not reported


def test_updates_are_unique_per_site_and_key_and_count_their_bytes(store, running):
    with store.transaction() as tx:
        tx.record_update(_update(store, "u-2", "s1", received_ms=20))
    u = store.update_by_key("t-1", "s1")
    assert isinstance(u, UpdateRecord) and u == _update(store, "u-2", "s1", received_ms=20)
    assert store.has_update("t-1", 1, "s1") and not store.has_update("t-1", 1, "s2")
    assert store.update_count("t-1", 1) == 1 and store.round("t-1", 1).uplink_bytes == 16
    assert store.outstanding_assignments("t-1", 1) == 1 and store.active_assignments("t-1", 1, 2) == 1
    for dup in (_update(store, "u-3", "s1", key="other"), _update(store, "u-4", "s2", key="s1")):
        with pytest.raises(DUPLICATE):
            with store.transaction() as tx:
                tx.record_update(dup)
    assert store.update_count("t-1", 1) == 1 and store.round("t-1", 1).uplink_bytes == 16  # rolled back whole
    with store.transaction() as tx:
        tx.record_update(_update(store, "u-1", "s2", received_ms=5))
        tx.add_uplink("t-1", 1, 100)
    assert [x.update_id for x in store.updates_of("t-1", 1)] == ["u-1", "u-2"]  # in the order received
    assert store.spill_paths() == {str(store.state_dir / "u-1.bin"), str(store.state_dir / "u-2.bin")}
    assert store.round("t-1", 1).uplink_bytes == 132


def test_downlink_is_charged_to_the_open_round_and_the_site(store, running):
    with store.transaction() as tx:
        tx.add_downlink("t-1", 50)
        tx.add_downlink("t-1", 30, site="s1", wire_bytes=35)
    assert store.round("t-1", 1).downlink_bytes == 80
    a = store.assignment("t-1", 1, "s1")
    assert (a.downlink_bytes, a.downlink_wire_bytes) == (30, 35)


def test_model_deltas_round_trip(store, running):
    header = tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[3], codec="int8", sha256="ab" * 32,
                                      encoded_nbytes=10)
    delta = tensors_pb2.DownlinkDelta(name="w", base_sha256="cd" * 32, header=header)
    with store.transaction() as tx:
        tx.put_model_deltas("m1", [delta])
    assert store.model_deltas("m1") == {"w": delta} and store.model_deltas("m2") == {}


def test_events_go_to_on_commit_after_the_commit_and_never_after_a_rollback(store, running):
    seen: list[list[dict]] = []
    store.on_commit = seen.append
    with pytest.raises(RuntimeError):
        with store.transaction() as tx:
            tx.add_event("t-1", "held", "rolled back", actor="s1")
            tx.hold("t-1", 1, "s1", "gone")
            raise RuntimeError("boom")
    assert seen == [] and store.assignment("t-1", 1, "s1").held == ""
    with store.transaction() as tx:
        tx.add_event("t-1", "held", "s1 holds", actor="s1", round=1)
        tx.add_event("t-1", "declined", "s2 declined")
    assert [[e["kind"] for e in batch] for batch in seen] == [["held", "declined"]]
    assert seen[0][0] == {"task_id": "t-1", "kind": "held", "message": "s1 holds", "actor": "s1",
                          "details": {"round": 1}}
    events = store.events_of("t-1")
    assert all(isinstance(e, EventRecord) for e in events) and [e.message for e in events] == ["s1 holds",
                                                                                             "s2 declined"]
    assert store.events_of("t-1", after_seq=events[0].seq) == events[1:] and store.events_of("t-0") == []


def test_gauges_count_only_open_rounds_of_running_tasks(store, running):
    with store.transaction() as tx:
        tx.record_update(_update(store, "u-1", "s1"))
    g = store.gauges()
    assert (g.tasks_by_state, g.open_rounds, g.pending_updates, g.outstanding_assignments) == (
        {S.TASK_STATE_RUNNING: 1}, 1, 1, 1)
    with store.transaction() as tx:
        tx.end_task("t-1", S.TASK_STATE_CANCELLED, "cancelled by alice", 500)
    g = store.gauges()
    assert (g.tasks_by_state, g.open_rounds, g.pending_updates, g.outstanding_assignments) == (
        {S.TASK_STATE_CANCELLED: 1}, 0, 0, 0)
    assert store.open_rounds() == [] and len(store.open_rounds(running_only=False)) == 1


def test_state_survives_a_reopen(open_test_store):
    store = open_test_store()
    with store.transaction() as tx:
        model = tx.put_model(ModelPackage({"w": np.zeros(2, np.float32)}).manifest())
        tx.insert_task("t-1", "alice", "k", _spec(), S.TASK_STATE_QUEUED, 1, model)
        tx.open_round("t-1", 1, 1, 1, 2, 3, model)
    before = (store.task("t-1"), store.rounds_of("t-1"), store.model(model))
    store.close()
    again = open_test_store()
    assert (again.task("t-1"), again.rounds_of("t-1"), again.model(model)) == before


def test_task_models_and_blobs_are_those_of_the_task_only(store, running):
    """task_blobs answers "which blobs may be streamed through this task": its models' tensors and files and their
    encoded changes, never another task's, even when that task's blobs exist."""
    first = ModelPackage({"w": np.zeros(3, np.float32)}, {"vocab.json": b"{}"}).manifest()
    second = ModelPackage({"w": np.ones(3, np.float32)}).manifest()
    other = ModelPackage({"w": np.full(3, 7, np.float32)}).manifest()
    header = tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[3], codec="int8", sha256="ab" * 32,
                                      encoded_nbytes=10)
    with store.transaction() as tx:
        m1, m2, m3 = tx.put_model(first), tx.put_model(second), tx.put_model(other)
        tx.put_model_deltas(m2, [tensors_pb2.DownlinkDelta(name="w", base_sha256="cd" * 32, header=header)])
        tx.insert_task("t-2", "bob", "key-2", _spec(), S.TASK_STATE_QUEUED, 100, m1)
        tx.open_round("t-2", 1, 1, 1, 110, 5000, m1)
        tx.close_round("t-2", 1, 200, m2, {}, {})
        tx.open_round("t-2", 2, 1, 1, 210, 5000, m2)
        tx.insert_task("t-3", "carol", "key-3", _spec(), S.TASK_STATE_QUEUED, 100, m3)
    assert store.task_models("t-2") == {m1, m2}
    assert store.task_blobs("t-2") == ({t.sha256 for t in first.tensors} | {f.sha256 for f in first.files}
                                       | {t.sha256 for t in second.tensors} | {"ab" * 32})
    assert not store.task_blobs("t-2") & {t.sha256 for t in other.tensors}
    assert store.task_models("t-3") == {m3} and store.task_blobs("t-3") == {t.sha256 for t in other.tensors}
    assert store.task_models("nope") == frozenset() and store.task_blobs("nope") == frozenset()
    assert store.task_blobs("t-1") == {t.sha256 for t in store.model(running).tensors}
