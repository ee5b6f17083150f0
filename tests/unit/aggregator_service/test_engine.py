"""The round engine driven directly (no gRPC): refused folds leave no trace; state survives a new engine; update
admission owns its spill files."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fedclinic.errors import Refused
from fedclinic.transport.package import ModelPackage
from fedclinic.proto import control_pb2

from tests.helpers.engine import assign_sites, make_engine, send_update, submit_task, update_stream


def _spill_files(root):
    return sorted(p for p in (root / "updates").rglob("*") if p.is_file())


def test_refused_fold_leaves_no_trace_and_the_round_completes(tmp_path, open_test_store):
    store, engine = make_engine(tmp_path, open_test_store(tmp_path))  # on SQLite and on PostgreSQL
    pkg = ModelPackage({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    task_id = submit_task(engine, pkg, min_sites=3, num_rounds=1, strategy="multi-krum", strategy_params={"byzantine": 0})
    a = assign_sites(engine, ["s1", "s2", "s3"])
    full = {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    send_update(engine, "s1", a["s1"], full)
    with pytest.raises(Refused, match="same tensors") as exc:
        send_update(engine, "s2", a["s2"], {"w": np.ones(4, np.float32)}, key="bad")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert store.update_count(task_id, 1) == 1
    assert len([p for p in (tmp_path / "updates").rglob("*.bin")]) == 1
    send_update(engine, "s2", a["s2"], full)
    send_update(engine, "s3", a["s3"], {k: 3 * v for k, v in full.items()})
    status = store.task(task_id)
    assert status.state == control_pb2.TASK_STATE_COMPLETED
    final = store.model(status.final_model)
    w = engine.blobs.array(final.tensor("w").sha256, "float32", (4,))
    np.testing.assert_allclose(w, (1 + 1 + 3) / 3, rtol=1e-6)  # f=0 keeps all n-f=3, equal sample weights


def test_strategy_state_and_open_round_survive_a_new_engine(tmp_path, open_test_store):
    store, engine = make_engine(tmp_path, open_test_store(tmp_path))  # on SQLite and on PostgreSQL
    pkg = ModelPackage({"w": np.zeros(3, np.float32)})
    task_id = submit_task(engine, pkg, min_sites=2, num_rounds=2, strategy="fedadam", strategy_params={"server_lr": 0.1})
    a = assign_sites(engine, ["s1", "s2"])
    send_update(engine, "s1", a["s1"], {"w": np.ones(3, np.float32)})
    send_update(engine, "s2", a["s2"], {"w": np.ones(3, np.float32)})
    row = store.round(task_id, 1)
    assert "m/w" in row.strategy_state and "v/w" in row.strategy_state
    b = assign_sites(engine, ["s1", "s2"])
    send_update(engine, "s1", b["s1"], {"w": np.ones(3, np.float32)}, key="r2-s1")
    store.close()
    store2, engine2 = make_engine(tmp_path, open_test_store(tmp_path))  # a restart mid-round 2: rebuilt from disk
    engine2.recover()
    engine2.site_connected("s2")
    send_update(engine2, "s2", b["s2"], {"w": np.ones(3, np.float32)}, key="r2-s2")
    final = store2.model(store2.task(task_id).final_model)
    got = engine2.blobs.array(final.tensor("w").sha256, "float32", (3,))
    # FedAdam by hand: two rounds with Delta = 1, eta 0.1, beta1 0.9, beta2 0.99, tau 1e-3, v0 = tau^2
    x, m, v = 0.0, 0.0, 1e-6
    for _ in range(2):
        m = 0.9 * m + 0.1
        v = 0.99 * v + 0.01
        x += 0.1 * m / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(got, x, rtol=1e-5)


def test_a_task_fails_at_once_when_its_named_sites_decline_it_below_quorum(tmp_path):
    """Permanent refusals (policy, privacy budget, data contract) by the sites a task names: the task fails when
    fewer than min_sites are left, with every reason, instead of waiting out its deadlines and retries."""
    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    named = submit_task(engine, pkg, min_sites=2, num_rounds=2, sites=["s1", "s2", "s3"])
    a = assign_sites(engine, ["s1", "s2"])  # the round's target is 2 sites
    engine.decline("s1", named, a["s1"].round, "dataset 'd' is not allowed by this site's policy", permanent=True)
    engine.decline("s2", named, a["s2"].round, "busy this week", permanent=False)
    assert store.task(named).state == control_pb2.TASK_STATE_RUNNING
    engine.decline("s2", named, a["s2"].round, "privacy budget exhausted", permanent=True)
    task = store.task(named)
    assert task.state == control_pb2.TASK_STATE_FAILED
    assert ("quorum can no longer be reached: 2 of the task's 3 site(s) declined it for good (s1: dataset 'd' is not "
            "allowed by this site's policy; s2: privacy budget exhausted), which leaves 1 (s3) for min_sites 2"
            in task.error)
    store, engine = make_engine(tmp_path / "second")
    open_to_all = submit_task(engine, pkg, min_sites=2, num_rounds=1)  # any site may still connect: it waits
    b = assign_sites(engine, ["s1", "s2"])
    for site in ("s1", "s2"):
        engine.decline(site, open_to_all, b[site].round, "no", permanent=True)
    assert store.task(open_to_all).state == control_pb2.TASK_STATE_RUNNING


def test_a_hold_is_shown_until_the_site_reports_and_is_refused_without_an_open_assignment(tmp_path):
    """A site holding its assignment (awaiting approval) is shown to the owner with its reason, once per change;
    the hold ends when the site releases it or reports; a hold without an open assignment is refused."""
    from aggregator_service.status import status_of

    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    task_id = submit_task(engine, pkg, min_sites=2, num_rounds=1)
    a = assign_sites(engine, ["s1", "s2"])
    engine.hold("s1", task_id, a["s1"].round, "awaiting approval  by\nits IT")
    engine.hold("s1", task_id, a["s1"].round, "awaiting approval by its IT")  # the same again: no new event
    engine.hold("s2", task_id, a["s2"].round, "awaiting approval by its IT")
    assert list(status_of(store, task_id).rounds[0].held) == ["s1: awaiting approval by its IT",
                                                            "s2: awaiting approval by its IT"]
    events = [e.message for e in store.events_of(task_id) if e.kind == "held"]
    assert events == ["s1 holds round 1: awaiting approval by its IT", "s2 holds round 1: awaiting approval by its IT"]
    engine.hold("s2", task_id, a["s2"].round, "")
    assert list(status_of(store, task_id).rounds[0].held) == ["s1: awaiting approval by its IT"]
    send_update(engine, "s1", a["s1"], {"w": np.ones(4, np.float32)})  # reported: no longer shown as held
    assert list(status_of(store, task_id).rounds[0].held) == []
    # a stake in what it writes (aggregator_service.stakes): never assigned, or a task that does not exist, is
    # PERMISSION_DENIED alike; assigned to the task but not to that round, FAILED_PRECONDITION
    with pytest.raises(Refused, match="s3 was never assigned to task .*; a site can only hold tasks") as exc:
        engine.hold("s3", task_id, 1, "awaiting approval")
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(Refused, match="s1 has no assignment to round 2") as exc:
        engine.hold("s1", task_id, 2, "awaiting approval")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(Refused, match="was never assigned") as exc:
        engine.hold("s1", "t-000000000000", 1, "awaiting approval")
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_admission_removes_the_spill_file_of_every_refused_upload(tmp_path):
    """Update admission owns its spill files: a stream that breaks its commit, a refusal after the bytes arrived
    (the strategy's), and a duplicate with a new key leave no file behind; an accepted update keeps exactly one."""
    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    submit_task(engine, pkg, min_sites=3, num_rounds=1, strategy="multi-krum", strategy_params={"byzantine": 0})
    a = assign_sites(engine, ["s1", "s2", "s3"])
    full = {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    h, messages = update_stream("s1", a["s1"], full, declared=7)  # the commit lies about the byte count
    with pytest.raises(Refused, match="update rejected: commit declares 7 bytes, 24 arrived") as exc:
        engine.submit_update("s1", h, iter(messages))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _spill_files(tmp_path) == [] and store.update_count(a["s1"].task_id, 1) == 0
    h, messages = update_stream("s1", a["s1"], full)
    with pytest.raises(Refused, match="ended before its commit message"):
        engine.submit_update("s1", h, iter(messages[:-1]))
    assert _spill_files(tmp_path) == []
    first = send_update(engine, "s1", a["s1"], full)
    assert len(_spill_files(tmp_path)) == 1
    with pytest.raises(Refused, match="same tensors"):  # refused by the strategy once the bytes are durable
        send_update(engine, "s2", a["s2"], {"w": np.ones(4, np.float32)}, key="partial")
    with pytest.raises(Refused, match="already sent an update") as exc:  # refused at the header
        send_update(engine, "s1", a["s1"], full, key="another-key")
    assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(_spill_files(tmp_path)) == 1
    h, messages = update_stream("s1", a["s1"], full)  # a retry: acknowledged, nothing read or kept
    receipt = engine.submit_update("s1", h, iter(messages))
    assert receipt.duplicate and receipt.update_id == first and len(_spill_files(tmp_path)) == 1


def test_a_stream_that_breaks_midway_leaves_no_spill_file(tmp_path):
    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    submit_task(engine, pkg, min_sites=2, num_rounds=1)
    a = assign_sites(engine, ["s1", "s2"])
    h, messages = update_stream("s1", a["s1"], {"w": np.ones(4, np.float32)})

    def broken():
        yield from messages[:-1]
        raise ConnectionResetError("the agent went away")

    with pytest.raises(ConnectionResetError):
        engine.submit_update("s1", h, broken())
    assert _spill_files(tmp_path) == [] and store.update_count(a["s1"].task_id, 1) == 0


def test_the_engine_parts_import_without_the_engine_and_the_validator_without_torch():
    """No cycle through the engine: secure aggregation and the metrics know it only by Protocol; the task-spec
    validator the aggregator runs at submit does not load torch (the aggregator image has none)."""
    import subprocess
    import sys

    code = ("import sys; import aggregator_service.secure_rounds, aggregator_service.metrics, "
            "aggregator_service.update_admission, aggregator_service.rounds, fedclinic.spec; "
            "assert 'aggregator_service.engine' not in sys.modules, 'engine imported'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_per_patient_task_refuses_an_update_whose_dp_report_is_not_per_patient(tmp_path):
    """An agent that does not know privacy.unit would train per row and report no unit: its update is refused,
    and one reporting unit "patient" is admitted."""
    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    task_id = submit_task(engine, pkg, min_sites=1, num_rounds=1, privacy={
        "level": "sample", "unit": "patient", "target_epsilon": 4.0})
    a = assign_sites(engine, ["s1"])
    delta = {"w": np.ones(4, np.float32)}
    for unit in ("", "example"):
        h, messages = update_stream("s1", a["s1"], delta, key=f"k-{unit}")
        h.dp.unit = unit
        with pytest.raises(Refused, match="protects each patient") as exc:
            engine.submit_update("s1", h, iter(messages))
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    h, messages = update_stream("s1", a["s1"], delta)
    h.dp.unit = "patient"
    engine.submit_update("s1", h, iter(messages))
    assert store.update_count(task_id, 1) == 1 or store.task(task_id).state == control_pb2.TASK_STATE_COMPLETED


def test_a_returning_site_hears_which_of_its_open_tasks_ended_and_nothing_of_others(tmp_path):
    """WatchWork's ``open_tasks`` (Engine.ended_work): a cancellation for each named task that ended and was assigned
    to the site (``completed`` for a completed one); a running task, a task of others and an unknown id: nothing."""
    store, engine = make_engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(2, np.float32)})
    cancelled = submit_task(engine, pkg, min_sites=2, num_rounds=2)
    assign_sites(engine, ["s1", "s2"])
    engine.cancel(cancelled, "alice", "wrong cohort")
    done = submit_task(engine, pkg, key="key-2", min_sites=1, num_rounds=1, sites=["s1"])
    a = assign_sites(engine, ["s1"])
    send_update(engine, "s1", a["s1"], {"w": np.ones(2, np.float32)})
    assert store.task(done).state == control_pb2.TASK_STATE_COMPLETED
    running = submit_task(engine, pkg, key="key-3", min_sites=2, num_rounds=1, sites=["s1", "s2"])
    assign_sites(engine, ["s1"])
    items = engine.ended_work("s1", [cancelled, done, running, "t-unknown", cancelled])
    assert [(i.cancel.task_id, i.cancel.completed) for i in items] == [(cancelled, False), (done, True)]
    assert "wrong cohort" in items[0].cancel.reason
    # s3 was never assigned any of them: a task id is not a capability
    assert engine.ended_work("s3", [cancelled, done, running]) == []
