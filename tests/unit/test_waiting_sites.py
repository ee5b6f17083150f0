"""Who an open round waits for, as `fedclinic task status` and the `watch` bar show it to the task's owner."""

import io

from fedclinic.client import ProgressDisplay, held_sites, waiting_sites
from fedclinic.proto import control_pb2, task_pb2


def _status(*, state=control_pb2.ROUND_STATE_OPEN, secure=False) -> control_pb2.TaskStatus:
    spec = task_pb2.TaskSpec(name="t", rounds=task_pb2.RoundConfig(num_rounds=2),
                             secure_aggregation=task_pb2.SecureAggregationConfig(enabled=secure))
    rnd = control_pb2.RoundSummary(round=1, state=state, sites_target=4,
                                   sites_assigned=["st-luke", "st-mary", "st-anne", "st-paul"],
                                   reports=[control_pb2.SiteReport(site_id="st-luke")],
                                   declined=["st-paul: rejected at st-paul: not covered: by our ethics approval"],
                                   held=["st-mary: awaiting approval by the site's IT (approval = \"manual\")"])
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
    assert "sites 1/4 (waiting for st-anne, st-mary [held])" in out.getvalue()


def test_held_sites_and_their_reasons_while_the_round_is_open():
    assert held_sites(_status()) == {"st-mary": 'awaiting approval by the site\'s IT (approval = "manual")'}
    assert held_sites(_status(state=control_pb2.ROUND_STATE_CLOSED)) == {}
    assert held_sites(control_pb2.TaskStatus(task_id="t-1")) == {}


def test_the_watch_bar_marks_a_held_site_and_prints_the_hold():
    out = io.StringIO()
    display = ProgressDisplay(out, tty=True)
    display.update(control_pb2.TaskEvent(kind="update-received", status=_status()))
    assert "(waiting for st-anne, st-mary [held])" in out.getvalue()
    display.update(control_pb2.TaskEvent(kind="held", message="st-mary holds round 1: awaiting approval",
                                         status=_status()))
    assert "\n  st-mary holds round 1: awaiting approval\n" in out.getvalue()
