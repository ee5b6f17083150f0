"""The site privacy ledger: admission, charge-before-send, concurrency across processes, crash safety."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hospital_agent.privacy_ledger import BudgetExceeded, PrivacyLedger

ROOT = Path(__file__).resolve().parents[3]


def _ledger(tmp_path, eps=8.0, delta=1e-4) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    ledger.set_budget("notes", eps, delta)
    return ledger


def test_admit_then_charge_then_finish(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.admit("notes", "t1", 3.0, 1e-5)
    ledger.charge("notes", "t1", 0, 1.0)
    ledger.charge("notes", "t1", 1, 2.5)
    ledger.charge("notes", "t1", 1, 2.0)  # a repeated charge of a round keeps the larger spend
    [spend] = ledger.status()
    assert spend.spent_epsilon == 2.5 and spend.committed_epsilon == 3.0
    assert spend.tasks[0].rounds_charged == 2
    ledger.finish("notes", "t1")
    [spend] = ledger.status()
    assert spend.committed_epsilon == 2.5 and spend.remaining_epsilon == pytest.approx(5.5)


def test_a_task_that_would_exceed_the_budget_is_refused_before_training(tmp_path):
    ledger = _ledger(tmp_path, eps=4.0)
    ledger.admit("notes", "t1", 3.0, 1e-5)
    with pytest.raises(BudgetExceeded, match="only epsilon 1 .* is left.*lower the task's target epsilon"):
        ledger.admit("notes", "t2", 1.5, 1e-5)
    ledger.admit("notes", "t2", 1.0, 1e-5)  # what is left still fits
    ledger.admit("notes", "t2", 1.0, 1e-5)  # re-admission after a restart is a no-op
    assert [t.task_id for t in ledger.status()[0].tasks] == ["t1", "t2"]


def test_deltas_add_up_too(tmp_path):
    ledger = _ledger(tmp_path, eps=100.0, delta=2e-5)
    ledger.admit("notes", "t1", 1.0, 1e-5)
    ledger.admit("notes", "t2", 1.0, 1e-5)
    with pytest.raises(BudgetExceeded, match="delta"):
        ledger.admit("notes", "t3", 1.0, 1e-5)


def test_charges_are_refused_when_they_would_overspend(tmp_path):
    ledger = _ledger(tmp_path, eps=5.0)
    with pytest.raises(BudgetExceeded, match="never admitted"):
        ledger.charge("notes", "ghost", 0, 0.1)
    ledger.admit("notes", "t1", 2.0, 1e-5)
    with pytest.raises(BudgetExceeded, match="more than the 2 it was admitted with"):
        ledger.charge("notes", "t1", 0, 2.5)
    ledger.admit("notes", "t2", 3.0, 1e-5)
    ledger.set_budget("notes", 4.0, 1e-4)  # the privacy officer lowered the budget after admission
    ledger.charge("notes", "t1", 0, 1.0)
    with pytest.raises(BudgetExceeded, match="would exceed the budget"):
        ledger.charge("notes", "t1", 1, 1.5)
    ledger.finish("notes", "t1")
    with pytest.raises(BudgetExceeded, match="finished"):
        ledger.charge("notes", "t1", 2, 1.0)
    assert ledger.status()[0].spent_epsilon == 1.0  # refused charges changed nothing


def test_a_dataset_without_budget_refuses_private_tasks(tmp_path):
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    with pytest.raises(BudgetExceeded, match=r"privacy_epsilon and privacy_delta under \[datasets.notes\]"):
        ledger.admit("notes", "t1", 1.0, 1e-5)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "charge", "finish", "budget"]), st.integers(0, 3),
                              st.floats(0.0, 4.0)), max_size=30))
def test_no_sequence_of_operations_lets_committed_spend_exceed_the_budget(tmp_path_factory, ops):
    ledger = _ledger(tmp_path_factory.mktemp("l"), eps=6.0, delta=1.0 - 1e-9)
    rounds: dict[str, int] = {}
    for op, task, value in ops:
        tid = f"t{task}"
        try:
            if op == "admit":
                ledger.admit("notes", tid, value, 1e-9)
            elif op == "charge":
                rounds[tid] = rounds.get(tid, 0) + 1
                ledger.charge("notes", tid, rounds[tid], value)
            elif op == "finish":
                ledger.finish("notes", tid)
            else:
                ledger.set_budget("notes", max(value, 0.5) + 4.0, 1.0 - 1e-9)
        except BudgetExceeded:
            pass
        [spend] = ledger.status()
        assert spend.spent_epsilon <= 8.0 + 1e-9  # never above the largest budget ever set
        for t in spend.tasks:
            assert t.spent_epsilon <= t.planned_epsilon + 1e-9


_ADMIT = textwrap.dedent("""
    import sys
    from hospital_agent.privacy_ledger import BudgetExceeded, PrivacyLedger
    ledger = PrivacyLedger(sys.argv[1])
    try:
        ledger.admit("notes", sys.argv[2], 1.0, 1e-9)
        print("admitted")
    except BudgetExceeded:
        print("refused")
""")


def test_concurrent_processes_never_overbook(tmp_path):
    _ledger(tmp_path, eps=5.0)
    procs = [subprocess.Popen([sys.executable, "-c", _ADMIT, str(tmp_path / "ledger.sqlite"), f"task{i}"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for i in range(12)]
    answers = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), answers
    assert answers.count("admitted") == 5 and answers.count("refused") == 7
    assert PrivacyLedger(tmp_path / "ledger.sqlite").status()[0].committed_epsilon == pytest.approx(5.0)


_CHARGE_THEN_DIE = textwrap.dedent("""
    import os, sys
    from hospital_agent.privacy_ledger import PrivacyLedger
    ledger = PrivacyLedger(sys.argv[1])
    ledger.charge("notes", "t1", 3, 1.75)
    os._exit(9)  # killed after the charge, before the update was written or sent
""")


def test_a_crash_between_charge_and_send_keeps_the_spend(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.admit("notes", "t1", 2.0, 1e-5)
    proc = subprocess.run([sys.executable, "-c", _CHARGE_THEN_DIE, str(tmp_path / "ledger.sqlite")], cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 9
    reopened = PrivacyLedger(tmp_path / "ledger.sqlite")
    [spend] = reopened.status()
    assert spend.spent_epsilon == 1.75 and spend.tasks[0].rounds_charged == 1
    reopened.charge("notes", "t1", 3, 1.75)  # the resend after restart charges the same round again: no change
    assert reopened.status()[0].spent_epsilon == 1.75


# ------------------------------------------------------------------------------------------------------------
# a task that ended gives its unspent reservation back


def test_finishing_a_task_releases_what_it_did_not_spend(tmp_path):
    ledger = _ledger(tmp_path, eps=8.0)
    ledger.admit("notes", "t1", 6.0, 1e-5)
    ledger.charge("notes", "t1", 1, 2.0)
    with pytest.raises(BudgetExceeded, match="only epsilon 2 .* is left"):
        ledger.admit("notes", "t2", 4.0, 1e-5)  # t1's unspent 4 is still reserved while it runs
    assert ledger.finish("notes", "t1") is True
    [spend] = ledger.status()
    assert spend.committed_epsilon == 2.0 and spend.spent_epsilon == 2.0 and spend.tasks[0].finished
    ledger.admit("notes", "t2", 4.0, 1e-5)  # fits now
    assert ledger.finish("notes", "t1") is False and ledger.finish("notes", "unknown") is False
    with pytest.raises(BudgetExceeded, match="finished"):
        ledger.charge("notes", "t1", 2, 3.0)  # an ended task is charged no more
    [spend] = ledger.status()
    assert spend.spent_epsilon == 2.0 and spend.committed_epsilon == 6.0


def test_a_cancellation_finishes_the_task_on_every_dataset_it_used(tmp_path):
    ledger = _ledger(tmp_path, eps=5.0, delta=2e-5)
    ledger.set_budget("labs", 5.0, 2e-5)
    ledger.admit("notes", "t1", 3.0, 1e-5)
    ledger.admit("labs", "t1", 3.0, 1e-5)
    ledger.admit("labs", "t2", 2.0, 1e-5)
    ledger.charge("labs", "t1", 1, 0.5)
    assert ledger.finish_task("t1") == ["labs", "notes"]
    assert ledger.finish_task("t1") == []
    spend = {d.dataset: d for d in ledger.status()}
    assert spend["labs"].committed_epsilon == 2.5 and spend["labs"].committed_delta == pytest.approx(2e-5)
    # nothing spent on notes: its epsilon and delta are all back
    assert spend["notes"].committed_epsilon == 0.0 and spend["notes"].committed_delta == 0.0
    assert not next(t for t in spend["labs"].tasks if t.task_id == "t2").finished


def _private_spec(rounds: int):
    from fedclinic.proto import task_pb2

    return task_pb2.TaskSpec(family="text-classification", architecture="transformer", dataset="notes",
                             rounds=task_pb2.RoundConfig(num_rounds=rounds),
                             privacy=task_pb2.PrivacyConfig(level="sample", target_epsilon=3.0, target_delta=1e-5,
                                                            max_grad_norm=1.0, accountant="rdp"))


def test_the_site_finishes_a_task_after_charging_its_last_round(tmp_path):
    from hospital_agent.site_privacy import SitePrivacy

    site = SitePrivacy(tmp_path / "ledger.sqlite", {})
    site.ledger.set_budget("notes", 10.0, 1e-4)
    spec = _private_spec(rounds=3)
    private = site.admit("t1", spec, 200, batch_size=10, local_epochs=1)
    site.charge("t1", spec, 1, private)
    assert not site.ledger.status()[0].tasks[0].finished
    site.charge("t1", spec, 3, private)  # the last round (this site sat out round 2)
    [spend] = site.ledger.status()
    task = spend.tasks[0]
    assert task.finished and task.spent_epsilon < task.planned_epsilon
    assert spend.committed_epsilon == pytest.approx(task.spent_epsilon)


def test_a_task_that_ended_elsewhere_gives_its_reservation_back(tmp_path):
    from hospital_agent.site_privacy import SitePrivacy

    site = SitePrivacy(tmp_path / "ledger.sqlite", {})
    site.ledger.set_budget("notes", 10.0, 1e-4)
    spec = _private_spec(rounds=5)
    private = site.admit("t1", spec, 200, batch_size=10, local_epochs=1)
    report = site.charge("t1", spec, 1, private)
    assert site.task_ended("t1") == ["notes"]
    [spend] = site.ledger.status()
    assert spend.committed_epsilon == pytest.approx(report.epsilon)
    assert report.epsilon < private.plan.planned_epsilon
    with pytest.raises(BudgetExceeded, match="finished"):
        site.charge("t1", spec, 2, private)
    assert site.task_ended("t1") == []
