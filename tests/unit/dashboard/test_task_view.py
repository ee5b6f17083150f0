"""A TaskStatus as the dashboard shows it: site states, plots, results, and escaping of what sites send."""

from __future__ import annotations

import math

from fedclinic.dashboard.page_fragments import events, sites, task_sections
from fedclinic.dashboard.svg_plot import line_plot
from fedclinic.dashboard.task_events import TaskEvents
from fedclinic.dashboard.task_view import plot_series, task_view
from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import control_pb2

HOSTILE = '<img src=x onerror="alert(1)">'


def _status() -> control_pb2.TaskStatus:
    st = control_pb2.TaskStatus(task_id="t-1", state=control_pb2.TASK_STATE_RUNNING, owner="alice", signed=True)
    st.spec.name = "notes"
    st.spec.rounds.num_rounds = 3
    for rnd in (1, 2):
        r = st.rounds.add(round=rnd, attempt=1, state=control_pb2.ROUND_STATE_CLOSED, sites_target=2,
                          sites_assigned=["a", "b"], uplink_bytes=1000 * rnd, downlink_bytes=5000)
        r.metrics.update({"eval_accuracy": 0.5 + 0.1 * rnd, "eval_rows": 40, "eval_f1/cardio": 0.4,
                          "dp_epsilon": 1.5 * rnd, "eval_loss": float("nan")})
        for site in ("a", "b"):
            rep = r.reports.add(site_id=site, num_samples=20, uplink_bytes=500 * rnd)
            rep.metrics["loss"] = 1.0 / rnd
    r = st.rounds.add(round=3, attempt=1, state=control_pb2.ROUND_STATE_OPEN, sites_target=4,
                      sites_assigned=["a", "b", "c", "d"], declined=[f"d: {HOSTILE}"], held=[f"c: {HOSTILE}"])
    r.reports.add(site_id="a", num_samples=20, uplink_bytes=10)
    return st


def test_the_open_round_names_each_site_state_and_why():
    view = task_view(_status())
    assert [(s["site"], s["state"]) for s in view["sites"]] == [
        ("a", "reported"), ("b", "waiting"), ("c", "held"), ("d", "declined")]
    assert view["sites"][2]["detail"] == HOSTILE and view["sites_round_open"]
    assert view["rounds_closed"] == 2 and view["rounds"][1]["epsilon"] == 3.0
    html = sites(view)  # what a site sends is shown as text, never as markup
    assert HOSTILE not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    assert 'class="site site-held" data-site="c"' in html


def test_plots_have_one_point_per_closed_round_and_leave_counts_and_non_finite_values_out():
    plots = plot_series(_status())
    assert set(plots) == {"global", "sites", "bytes", "epsilon"}
    assert plots["global"]["series"] == {"eval_accuracy": [[1, 0.6], [2, 0.7]]}
    assert plots["bytes"]["series"]["up"] == [[1, 1000.0], [2, 2000.0]]
    assert plots["sites"]["series"] == {"a": [[1, 1.0], [2, 0.5]], "b": [[1, 1.0], [2, 0.5]]}
    assert plots["epsilon"]["series"]["sample-level DP ε (largest site)"] == [[1, 1.5], [2, 3.0]]
    svg = line_plot("bytes", "bytes", plots["bytes"]["series"], "B")
    assert svg.count('<circle class="pt"') == 4 and svg.count("<polyline") == 2 and "2 kB" in svg
    sections = task_sections(task_view(_status()), [], "")
    assert sections["plots"].count("<svg") == 4 and "eval_rows" not in sections["plots"]


def test_a_plot_escapes_its_labels_and_survives_empty_flat_and_non_finite_series():
    svg = line_plot("x", HOSTILE, {HOSTILE: [[1, 2.0], [2, math.inf]]})
    assert HOSTILE not in svg and svg.count('<circle class="pt"') == 1
    assert "no closed round yet" in line_plot("x", "t", {"s": []})
    assert line_plot("x", "t", {"s": [[1, 0.0], [2, 0.0]]}).count('<circle class="pt"') == 2


def test_results_show_the_matrix_with_suppressed_cells_and_the_pooled_row():
    st = _status()
    st.state = control_pb2.TASK_STATE_COMPLETED
    ph = st.results
    ph.work, ph.open = "evaluate", False
    ph.cells.add(site_id="a", model="final", rows=20).values.update({"accuracy": 0.75, "eval_rows": 20})
    ph.cells.add(site_id="b", model="final", suppressed=True)
    ph.pooled.add(model="final", sites=1).values.update({"accuracy": 0.75})
    view = task_view(st)
    m = view["results"]["matrix"]
    assert m["metric"] == "accuracy" and m["rows"] == {"a": {"final": 0.75}, "b": {"final": "suppressed"}}
    html = task_sections(view, [], "")["results"]
    assert "suppressed" in html and '<tr class="pooled"><td>pooled</td><td class="num">0.75</td>' in html


def test_events_are_followed_in_the_background_and_a_failure_becomes_the_note():
    class Event:
        def __init__(self, seq: int) -> None:
            self.seq, self.kind, self.message, self.unix_ms = seq, "round-closed", f"round {seq} {HOSTILE}", 0

    def watch(task_id: str):
        if task_id == "t-gone":
            raise FedclinicError("task t-gone not found")
        yield from (Event(i) for i in (1, 2, 3))

    follow = TaskEvents(watch)
    follow.events("t-1")
    wait_until(lambda: len(follow.events("t-1")[0]) == 3, 10, "the three events")
    items, note = follow.events("t-1")
    assert [e["seq"] for e in items] == [1, 2, 3] and note == ""
    assert HOSTILE not in events(items) and events(items).index("round 3") < events(items).index("round 1")
    follow.events("t-gone")
    wait_until(lambda: follow.events("t-gone")[1], 10, "the failure note")
    assert follow.events("t-gone")[1] == "events unavailable: task t-gone not found"


def test_a_statistics_task_shows_its_table_per_site_with_the_pooled_column():
    st = control_pb2.TaskStatus(task_id="t-2", state=control_pb2.TASK_STATE_COMPLETED)
    st.results.work = "statistics"
    st.site_statistics["a"].values.update({"rows": 20.0, "label/cardio": 8.0})
    st.site_statistics["b"].values.update({"rows": 30.0})
    st.pooled_statistics.update({"rows": 50.0, "label/cardio": 8.0})
    view = task_view(st)
    stats = view["results"]["statistics"]
    assert stats["sites"] == ["a", "b"] and stats["keys"] == ["label/cardio", "rows"]
    html = task_sections(view, [], "")["results"]
    assert '<table class="statistics">' in html and "<th>pooled</th>" in html and 'class="matrix"' not in html
    assert '<tr><td>rows</td><td class="num">20</td><td class="num">30</td><td class="num">50</td></tr>' in html
