"""Sample-level DP over the real services: every site trains with DP-SGD, charges its ledger before sending,
reports its spend; a site whose budget cannot cover the task refuses it and the owner hears why."""

from __future__ import annotations

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.spec.task import Task
from hospital_agent.privacy_ledger import PrivacyLedger

from tests.helpers.text_models import LABELS, tiny_package, write_site_data

pytestmark = pytest.mark.integration


def _sites(tmp_path, budgets: dict[str, float]) -> list[SiteSetup]:
    sites = []
    for i, (name, eps) in enumerate(budgets.items()):
        path = write_site_data(tmp_path / "data" / name, 24 + 8 * i, seed=i)
        sites.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl",
                                                         "privacy_epsilon": eps, "privacy_delta": 1e-4}}))
    return sites


def _task(**kw) -> Task:
    args = dict(name="dp-it", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=2, min_sites=2,
                local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16,
                round_timeout_s=180, on_quorum_miss="fail",
                privacy={"level": "sample", "target_epsilon": 4.0, "target_delta": 1e-5, "max_grad_norm": 1.0})
    args.update(kw)
    return Task(**args)


def test_private_task_charges_every_site_before_sending(tmp_path):
    sites = _sites(tmp_path, {"site-a": 10.0, "site-b": 10.0})
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(_task(), package=tiny_package("transformer"))
            final = client.wait(st.task_id, timeout=300, progress=False)
            folder = client.download(st.task_id, tmp_path / "final-model")
        assert state_name(final.state) == "completed", final.error
        import json

        card = json.loads((folder / "model_card.json").read_text())
        assert card["privacy"]["level"] == "sample" and card["privacy"]["target_epsilon"] == 4.0
        assert card["privacy"]["epsilon_spent_max_site"] == pytest.approx(final.rounds[1].metrics["dp_epsilon"])
        first, last = final.rounds[0].metrics, final.rounds[1].metrics
        assert 0 < first["dp_epsilon"] < last["dp_epsilon"] <= 4.0 + 1e-6  # cumulative, within the target
        assert last["dp_delta"] == pytest.approx(1e-5)
        for report in final.rounds[1].reports:
            assert 0 < report.metrics["dp_epsilon"] <= 4.0 + 1e-6
        spends = {}
        for site in ("site-a", "site-b"):
            [spend] = PrivacyLedger(tmp_path / "fed" / f"agent-{site}" / "privacy-ledger.sqlite").status()
            assert spend.budget.epsilon == 10.0 and spend.tasks[0].rounds_charged == 2
            # the last round is charged: the task is finished there, nothing of it stays reserved beyond its spend
            assert spend.tasks[0].finished and spend.committed_epsilon == pytest.approx(spend.spent_epsilon)
            spends[site] = spend.spent_epsilon
            # what the site reported equals what its ledger charged
            reported = next(r.metrics["dp_epsilon"] for r in final.rounds[1].reports if r.site_id == site)
            assert spend.spent_epsilon == pytest.approx(reported)
        assert max(spends.values()) == pytest.approx(last["dp_epsilon"])


def test_a_site_without_enough_budget_refuses_and_the_owner_hears_why(tmp_path):
    sites = _sites(tmp_path, {"site-a": 10.0, "site-b": 1.0})
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            # the task names its sites: site-b's refusal (for good) leaves no quorum, so it fails at once
            st = client.submit(_task(num_rounds=1, round_timeout_s=300, sites=["site-a", "site-b"]),
                               package=tiny_package("transformer"))
            final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "failed"
        refusal = [d for d in final.rounds[0].declined if d.startswith("site-b")]
        assert refusal and "only epsilon 1" in refusal[0] and "privacy officer" in refusal[0]
        [spend] = PrivacyLedger(tmp_path / "fed" / "agent-site-b" / "privacy-ledger.sqlite").status()
        assert spend.tasks == () and spend.spent_epsilon == 0.0  # nothing reserved, nothing trained or sent
        if "site-a" in final.rounds[0].sites_assigned:
            # the failure reaches site-a on its work stream a moment after the owner sees it: stopping the agent
            # before would leave its reservation for the site's admin to finish (privacy_ledger's docstring)
            wait_until(lambda: any("task cancelled by aggregator" in line and st.task_id in line
                                   for line in fed.log_text("agent-site-a").splitlines()),
                       60, "site-a to hear that the task failed")
    # site-a may admit the task (reserving its planned epsilon) after the failure reached it: once its agent has
    # stopped (every assignment handled), nothing of the ended task stays reserved there
    [spend] = PrivacyLedger(tmp_path / "fed" / "agent-site-a" / "privacy-ledger.sqlite").status()
    assert all(t.finished for t in spend.tasks), spend
    assert spend.committed_epsilon == pytest.approx(spend.spent_epsilon), spend


def test_privacy_status_command_shows_budget_and_spend(tmp_path):
    import subprocess
    import sys

    sites = _sites(tmp_path, {"site-a": 6.0})
    fed = LocalFederation(tmp_path / "fed", sites, agent_threads=1)
    fed.make_pki()
    config = fed.write_agent_config("site-a", address="127.0.0.1:1")  # no aggregator runs: the command never dials
    ledger = PrivacyLedger(tmp_path / "fed" / "agent-site-a" / "privacy-ledger.sqlite")
    ledger.set_budget("notes", 6.0, 1e-4)
    ledger.admit("notes", "t-123", 4.0, 1e-5)
    ledger.charge("notes", "t-123", 0, 1.5)
    out = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "privacy", "status", "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("notes"))
    assert row.split()[1:] == ["6.000", "1.0e-04", "1.500", "4.000", "2.000"]
    assert "task t-123: planned 4.000, spent 1.500 (delta 1.0e-05) per example over 1 round(s), running" in out.stdout
    # the admin finishes a task the agent was never told had ended: its unspent 2.5 goes back to the budget
    cli = [sys.executable, "-m", "hospital_agent.cli", "privacy"]
    finish = cli + ["finish", "t-123", "--config", str(config)]
    out = subprocess.run(finish, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "task t-123 finished on notes" in out.stdout
    [spend] = ledger.status()
    assert spend.committed_epsilon == 1.5 and spend.tasks[0].finished
    out = subprocess.run(finish, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "holds no running reservation" in out.stderr
    audit = (tmp_path / "fed" / "agent-site-a" / "audit.jsonl").read_text()
    assert "privacy.reservation_released" in audit and "t-123" in audit


def _charge_round_one_alone(client, ledger: PrivacyLedger):
    """Submit a 3-round private task that needs 2 sites to the federation of site-a alone and wait until site-a
    trained and charged round 1 (the round then waits for a second site); the task's status."""
    st = client.submit(_task(num_rounds=3, min_sites=2, round_timeout_s=600), package=tiny_package("transformer"))

    def charged() -> bool:
        rows = ledger.status() if ledger.path.exists() else []
        return bool(rows and rows[0].tasks and rows[0].tasks[0].rounds_charged == 1)

    wait_until(charged, 180, "site-a to train and charge round 1")
    return st


def test_a_cancelled_task_gives_its_unspent_reservation_back(tmp_path):
    """One site trains round 1 of a 3-round private task (charged), the round waits for a second site; the owner
    cancels; the agent hears it on its work stream and releases the rest of the task's reservation."""
    sites = _sites(tmp_path, {"site-a": 10.0})
    ledger = PrivacyLedger(tmp_path / "fed" / "agent-site-a" / "privacy-ledger.sqlite")
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = _charge_round_one_alone(client, ledger)
            client.cancel(st.task_id, reason="wrong cohort")
            audit_path = tmp_path / "fed" / "agent-site-a" / "audit.jsonl"
            # the audit line is written after the ledger's release: wait for it, not for the ledger
            wait_until(lambda: "privacy.reservation_released" in audit_path.read_text(), 60,
                       "the agent to release the reservation")
    [spend] = ledger.status()
    assert spend.tasks[0].finished
    task = spend.tasks[0]
    assert 0 < task.spent_epsilon < task.planned_epsilon
    assert spend.committed_epsilon == pytest.approx(task.spent_epsilon)
    audit = (tmp_path / "fed" / "agent-site-a" / "audit.jsonl").read_text()
    assert "privacy.reservation_released" in audit and "wrong cohort" in audit


def test_an_agent_away_when_its_task_ends_gives_the_reservation_back_when_it_returns(tmp_path):
    """site-a trains and charges round 1, then its agent stops; the owner cancels the task while it is away. When
    the agent comes back its work stream names the task it still holds a reservation for, the aggregator answers
    that it ended, and the unspent rest goes back to the dataset's budget without the site's admin."""
    sites = _sites(tmp_path, {"site-a": 10.0})
    ledger = PrivacyLedger(tmp_path / "fed" / "agent-site-a" / "privacy-ledger.sqlite")
    audit_path = tmp_path / "fed" / "agent-site-a" / "audit.jsonl"
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = _charge_round_one_alone(client, ledger)
            assert fed.signal_agent("site-a") == 0  # the agent stops: nobody is there to hear the cancellation
            client.cancel(st.task_id, reason="wrong cohort")
            assert not ledger.status()[0].tasks[0].finished  # still reserved while the agent is away
            fed.start_agent("site-a")
            wait_until(lambda: "privacy.reservation_released" in audit_path.read_text(), 120,
                       "the returning agent to release the reservation")
    [spend] = ledger.status()
    task = spend.tasks[0]
    assert task.finished and 0 < task.spent_epsilon < task.planned_epsilon
    assert spend.committed_epsilon == pytest.approx(task.spent_epsilon)
    assert "task cancelled by aggregator" in fed.log_text("agent-site-a") and "wrong cohort" in audit_path.read_text()
