"""Result phases driven through the engine (no gRPC, a real store): who is given the work, holds, answers and
declines, when a phase closes (everyone answered, or its deadline: empty cells never fail the task), and the
final evaluation after a training task's last round."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from fedclinic.errors import Refused
from fedclinic.proto import agent_pb2, control_pb2
from fedclinic.transport.package import ModelPackage

from aggregator_service.status import status_of
from tests.helpers.engine import assign_sites, make_engine, send_update, submit_task

S = control_pb2
PKG = ModelPackage({"w": np.zeros(4, np.float32)})


def _hello(engine, site, results=True):
    engine.hello(site, ["results-v1"] if results else [], False, ["raw"])
    engine.site_connected(site)


def _answer(engine, site, a, rows=20.0, acc=0.5):
    return engine.submit_result(site, agent_pb2.SubmitResultRequest(
        task_id=a.task_id, round=a.round, work=a.work, model_hash=a.model.model_hash, results=[
            agent_pb2.ResultValues(model="model", values={"eval_rows": rows, "accuracy": acc})]))


def test_an_evaluate_task_gives_work_to_capable_sites_and_completes_when_all_answered(tmp_path):
    store, engine = make_engine(tmp_path)
    task_id = submit_task(engine, PKG, kind="evaluate", min_sites=1)
    assert store.task(task_id).state == S.TASK_STATE_RUNNING and not store.rounds_of(task_id)
    for site in ("s1", "s2"):
        _hello(engine, site)
    _hello(engine, "old", results=False)
    assert engine.next_work("old", {}) == []  # an older agent is given no result work
    (w1,), (_,) = engine.next_work("s1", {}), engine.next_work("s2", {})
    assert (w1.assignment.work, w1.assignment.round) == ("evaluate", 1)
    engine.hold("s1", task_id, 1, "awaiting approval by the site's IT")
    assert status_of(store, task_id).results.waiting == ["s1 (held: awaiting approval by the site's IT)", "s2"]
    assert _answer(engine, "s1", w1.assignment).stored == 1
    assert store.task(task_id).state == S.TASK_STATE_RUNNING  # s2 may still answer
    engine.decline("s2", task_id, 1, "site policy allow_evaluation = false", True)
    st = status_of(store, task_id)
    assert st.state == S.TASK_STATE_COMPLETED and not st.results.open and st.final_model_hash == st.initial_model_hash
    assert [(c.site_id, c.rows) for c in st.results.cells] == [("s1", 20)]
    assert st.results.declined == ["s2: site policy allow_evaluation = false"]
    with pytest.raises(Refused) as exc:  # the phase is over: nothing more is taken
        _answer(engine, "s1", w1.assignment)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_phase_closes_at_its_deadline_with_empty_cells(tmp_path):
    store, engine = make_engine(tmp_path)
    task_id = submit_task(engine, PKG, kind="evaluate", min_sites=1, sites=["s1", "never"],
                          evaluation={"timeout_s": 0.2})
    _hello(engine, "s1")
    (w,) = engine.next_work("s1", {})
    _answer(engine, "s1", w.assignment)
    assert store.task(task_id).state == S.TASK_STATE_RUNNING  # waits for "never"
    deadline = time.monotonic() + 30
    while store.task(task_id).state == S.TASK_STATE_RUNNING and time.monotonic() < deadline:
        engine.wait_for_change(engine.tick())
    st = status_of(store, task_id)
    assert st.state == S.TASK_STATE_COMPLETED and len(st.results.cells) == 1
    events = store.events_of(task_id)
    assert "the deadline passed" in [e for e in events if e.kind == "results-closed"][0].message


def test_the_final_evaluation_waits_only_for_capable_sites_that_trained(tmp_path):
    store, engine = make_engine(tmp_path)
    task_id = submit_task(engine, PKG, min_sites=2, num_rounds=1)
    _hello(engine, "s1")
    _hello(engine, "old", results=False)
    a = assign_sites(engine, ["s1", "old"])
    for site in ("s1", "old"):
        send_update(engine, site, a[site], {"w": np.ones(4, np.float32)})
    phase = store.result_phase(task_id)
    assert phase.round == 2 and phase.model_hash == store.rounds_of(task_id)[0].model_hash
    assert store.task(task_id).state == S.TASK_STATE_RUNNING
    (w,) = engine.next_work("s1", {})
    assert (w.assignment.work, w.assignment.round, w.assignment.model.model_hash) == ("evaluate", 2, phase.model_hash)
    with pytest.raises(Refused, match="takes \\['final', 'own'\\]"):
        _answer(engine, "s1", w.assignment)  # "model" is an evaluate task's name
    engine.submit_result("s1", agent_pb2.SubmitResultRequest(
        task_id=task_id, round=2, work="evaluate", model_hash=phase.model_hash,
        results=[agent_pb2.ResultValues(model="final", values={"eval_rows": 12.0, "accuracy": 0.75})]))
    st = status_of(store, task_id)
    assert st.state == S.TASK_STATE_COMPLETED and st.final_model_hash == phase.model_hash  # "old" not waited for
    assert st.results.pooled[0].values == {"eval_rows": 12.0, "accuracy": 0.75}
