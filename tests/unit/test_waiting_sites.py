"""Who an open round waits for, as `fedclinic task status` and the `watch` bar show it to the task's owner."""

import io

from fedclinic.client import ProgressDisplay, waiting_sites
from fedclinic.proto import control_pb2, task_pb2


def _status(*, state=control_pb2.ROUND_STATE_OPEN, secure=False) -> control_pb2.TaskStatus:
    spec = task_pb2.TaskSpec(name="t", rounds=task_pb2.RoundConfig(num_rounds=2),
                             secure_aggregation=task_pb2.SecureAggregationConfig(enabled=secure))
    rnd = control_pb2.RoundSummary(round=1, state=state, sites_target=4,
                                   sites_assigned=["st-luke", "st-mary", "st-anne", "st-paul"],
                                   reports=[control_pb2.SiteReport(site_id="st-luke")],
                                   declined=["st-paul: rejected at st-paul: not covered: by our ethics approval"])
    return control_pb2.TaskStatus(task_id="t-1", spec=spec, state=control_pb2.TASK_STATE_RUNNING, rounds=[rnd])


def test_the_open_round_waits_for_assigned_sites_without_an_update_or_a_refusal():
    assert waiting_sites(_status()) == ["st-anne", "st-mary"]


def test_nothing_is_waited_for_once_the_round_closed_or_under_secure_aggregation():
    assert waiting_sites(_status(state=control_pb2.ROUND_STATE_CLOSED)) == []
    assert waiting_sites(_status(secure=True)) == []  # masked rounds report no per-site updates
    assert waiting_sites(control_pb2.TaskStatus(task_id="t-1")) == []


def test_the_watch_bar_names_the_sites_the_round_waits_for():
    out = io.StringIO()
    ProgressDisplay(out, tty=True).update(control_pb2.TaskEvent(kind="update-received", status=_status()))
    assert "sites 1/4 (waiting for st-anne, st-mary)" in out.getvalue()
