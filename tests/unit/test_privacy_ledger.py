"""The site privacy ledger: admission, charge-before-send, concurrency across processes, crash safety."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hospital_agent.privacy_ledger import BudgetExceeded, PrivacyLedger

ROOT = Path(__file__).resolve().parents[2]


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
