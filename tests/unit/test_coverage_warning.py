"""``fedclinic task watch``'s progress display warns once per site whose first update reports a tokenizer [UNK]
rate above 5 % (on a terminal and in plain lines)."""

from __future__ import annotations

import io

import pytest

from fedclinic.client import ProgressDisplay
from fedclinic.proto import control_pb2, task_pb2


def _event(rates: dict[str, float], kind: str = "update-received") -> control_pb2.TaskEvent:
    st = control_pb2.TaskStatus(task_id="t1", spec=task_pb2.TaskSpec(rounds=task_pb2.RoundConfig(num_rounds=2)))
    r = st.rounds.add(round=1)
    for site, rate in rates.items():
        r.reports.add(site_id=site, metrics={"tokenizer_unk_rate": rate, "loss": 0.5})
    r.reports.add(site_id="site-z", metrics={"loss": 0.4})  # no rate: nothing to say
    return control_pb2.TaskEvent(kind=kind, message="m", status=st)


@pytest.mark.parametrize("tty", [False, True])
def test_a_site_above_five_percent_is_warned_once(tty):
    out = io.StringIO()
    display = ProgressDisplay(out, tty=tty)
    display.update(_event({"site-a": 0.01}))
    display.update(_event({"site-a": 0.01, "site-b": 0.62}))
    display.update(_event({"site-a": 0.01, "site-b": 0.62}, kind="round-closed"))
    warnings = [line for line in out.getvalue().splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "site site-b: 62.0% of its tokens" in warnings[0]
    assert warnings[0].startswith("  warning:" if tty else "[t1] warning:")
